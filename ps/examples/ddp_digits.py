"""Tutorial: an ordinary DDP training script on scikit-learn digits, switched to LTP.

Run on CPU with two processes::

    LTP_PS_TRANSPORT=tcp torchrun --nproc-per-node 2 ps/examples/ddp_digits.py --epochs 8
    torchrun --nproc-per-node 2 ps/examples/ddp_digits.py --backend ltp --epochs 8

Everything below is plain PyTorch DDP except two lines marked ``<- LTP``: the
import (which also registers the ``ltp`` process-group backend) and the
registration of ``ltp_ps.ddp``'s communication hook, which sends each gradient
bucket to a parameter server (started on rank 0) over LTP and returns the
averaged bucket.  Delete both lines and the script trains with gloo's
allreduce instead; ``--backend ltp`` moves the process group's own
collectives (parameter broadcast, barriers) onto LTP's reliable mode too.
``--no-hook`` leaves the gradient all-reduce to the process group (with
``--backend ltp``: the ``ltp`` backend, exact); ``--hook-schedule`` picks the
hook's reduction (``direct`` = server on rank 0, ``ring``/``rsgcm`` = PS-less).
Rank 0 ends with one line ``RESULT {json}``: per-epoch accuracy and seconds,
and the seconds to reach ``--target`` test accuracy (null if never).  See
``docs/ddp.md``.
"""

import argparse
import json
import sys
import time

import torch
import torch._dynamo  # noqa: F401  (before init_process_group: see ddp_backend.teardown)
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ltp_ps.ddp  # <- LTP (also registers the "ltp" backend)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--backend", default="gloo", help="process-group backend: gloo or ltp")
    ap.add_argument("--no-hook", action="store_true", help="no LTP hook: the process group reduces gradients")
    ap.add_argument("--hook-schedule", default=None, help="direct | ring | rsgcm | auto")
    ap.add_argument("--target", type=float, default=0.95, help="test accuracy whose time is reported")
    args = ap.parse_args()

    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    d = load_digits()
    x = torch.tensor(d.images / 16.0, dtype=torch.float32)[:, None]
    y = torch.tensor(d.target)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    train = TensorDataset(xtr, ytr)
    sampler = DistributedSampler(train, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=32, sampler=sampler)

    model = DDP(Net())
    hook = None
    if not args.no_hook:
        hook = ltp_ps.ddp.register(model, schedule=args.hook_schedule)  # <- LTP: average gradient buckets over LTP
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    t0, accs, secs, reached = time.monotonic(), [], [], None
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for xb, yb in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            acc = (model(xte).argmax(1) == yte).float().mean().item()
        accs.append(acc)
        secs.append(time.monotonic() - t0)
        if reached is None and acc >= args.target:
            reached = secs[-1]
        if rank == 0:
            print(f"epoch {epoch + 1} loss {loss.item():.4f} test accuracy {acc:.4f}", flush=True)
    if rank == 0:
        print("RESULT " + json.dumps({"backend": args.backend, "hook": hook is not None, "world": dist.get_world_size(),
                                      "accuracy": accs, "seconds": secs, "target": args.target,
                                      "seconds_to_target": reached,
                                      "hook_stats": hook.stats.as_dict() if hook is not None else None}), flush=True)
    if hook is not None:
        hook.close()
    del model, opt, loss
    dist.destroy_process_group()
    if not accs or accs[-1] != accs[-1] or accs[-1] < 0.5:
        print(f"rank {rank}: training failed (test accuracy {accs})", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
