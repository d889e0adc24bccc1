"""An ordinary DDP training script; the backend is a command-line word (``gloo`` or ``ltp``).

Run on CPU::

    torchrun --nproc-per-node 4 -m ltp_ps.examples.ddp_backend --backend ltp --steps 20
    torchrun --nproc-per-node 4 -m ltp_ps.examples.ddp_backend --backend gloo --steps 20
    torchrun --nproc-per-node 2 -m ltp_ps.examples.ddp_backend --backend gloo --hook   # gloo + LTP hook

The only LTP-specific lines are ``import ltp_ps`` (registers the ``ltp``
backend) and, with ``--hook``, ``ltp_ps.ddp.register(model)``.  Everything
else is plain DDP: a synthetic regression task on an MLP, ``DistributedSampler``
(with ``drop_last=False``: the last batch is uneven when ``--samples`` is not a
multiple of world x batch), optional ``--accumulate K`` (``no_sync()`` on K-1
of every K micro-batches), ``--find-unused`` (a branch used on even steps
only), ``--bucket-cap-mb``.

``--check-collectives`` runs every collective once on inputs every rank can
predict, asserts the results, and saves them (``--out``) so a test can compare
two backends element by element.  ``--out DIR`` saves each rank's final
state dict and loss curve.  ``--die-rank R --die-step S`` makes rank R exit
abruptly in the middle of step S (after its forward pass), to test that the
other ranks fail with a clear error instead of hanging.

Exit status: 0 on success; non-zero if the loss is not finite, did not fall,
or a collective returned a wrong value.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import sys
import time

import torch
import torch._dynamo  # noqa: F401  (before init_process_group: see teardown())
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ltp_ps  # noqa: F401  (registers the "ltp" backend)


class Net(nn.Module):
    def __init__(self, d_in: int, hidden: int, depth: int, unused_branch: bool):
        super().__init__()
        layers, d = [], d_in
        for _ in range(depth):
            layers += [nn.Linear(d, hidden), nn.Tanh()]
            d = hidden
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(d, 1)
        self.side = nn.Linear(d, 1) if unused_branch else None

    def forward(self, x, use_side: bool = False):
        h = self.body(x)
        out = self.head(h)
        if self.side is not None and use_side:
            out = out + self.side(h)
        return out


def check_collectives(rank: int, world: int) -> dict:
    """Every collective on predictable inputs; returns {name: tensor}; raises AssertionError on a wrong value."""
    res: dict = {}

    def val(r, n=11, dtype=torch.float32):
        return (torch.arange(n, dtype=torch.float64) * (r + 1) + r).to(dtype)

    def expect(name, got, want):
        res[name] = got.clone()
        if not torch.equal(got, want):
            raise AssertionError(f"rank {rank}: {name}: got {got.flatten()[:8].tolist()}, "
                                 f"want {want.flatten()[:8].tolist()}")

    allv = [val(r) for r in range(world)]
    for op, ref in ((dist.ReduceOp.SUM, lambda ts: sum(ts[1:], ts[0].clone())),
                    (dist.ReduceOp.MIN, lambda ts: torch.stack(ts).min(0).values),
                    (dist.ReduceOp.MAX, lambda ts: torch.stack(ts).max(0).values),
                    (dist.ReduceOp.PRODUCT, lambda ts: torch.stack(ts).prod(0))):
        t = val(rank)
        dist.all_reduce(t, op=op)
        expect(f"all_reduce_{op}", t, ref(allv))
    for dtype in (torch.int64, torch.float64, torch.bfloat16):
        t = val(rank, 7, dtype)
        dist.all_reduce(t)
        expect(f"all_reduce_sum_{dtype}", t, sum((val(r, 7, dtype) for r in range(1, world)), val(0, 7, dtype)))
    big = torch.full((300_000,), float(rank + 1))  # above RING_MIN_BYTES: the ring path
    dist.all_reduce(big)
    expect("all_reduce_big", big, torch.full((300_000,), float(world * (world + 1) // 2)))
    nc = torch.arange(20.).reshape(4, 5).t() * (rank + 1)  # non-contiguous
    dist.all_reduce(nc)
    expect("all_reduce_noncontiguous", nc, torch.arange(20.).reshape(4, 5).t() * (world * (world + 1) // 2))
    xs = [val(rank) * k for k in range(1, 6)]
    works = [dist.all_reduce(t, async_op=True) for t in xs]
    for w in works:
        w.wait()
    for k, t in enumerate(xs, 1):
        expect(f"all_reduce_async_{k}", t, sum(allv[1:], allv[0].clone()) * k)
    b = val(rank) if rank == world - 1 else torch.zeros(11)
    dist.broadcast(b, src=world - 1)
    expect("broadcast", b, val(world - 1))
    outs = [torch.empty(11) for _ in range(world)]
    dist.all_gather(outs, val(rank))
    expect("all_gather", torch.stack(outs), torch.stack(allv))
    o = torch.empty(world * 11)
    dist.all_gather_into_tensor(o, val(rank))
    expect("all_gather_into_tensor", o, torch.cat(allv))
    chunks = [val(rank, 5) + 100 * j for j in range(world)]
    o = torch.empty(5)
    dist.reduce_scatter(o, chunks)
    expect("reduce_scatter", o, sum(val(r, 5) for r in range(world)) + 100 * rank * world)
    inp = torch.cat([val(rank, 6) + 10 * j for j in range(world)])
    o = torch.empty(6)
    dist.reduce_scatter_tensor(o, inp)
    expect("reduce_scatter_tensor", o, sum(val(r, 6) for r in range(world)) + 10 * rank * world)
    inp = torch.tensor([100.0 * rank + j for j in range(world)])
    o = torch.empty(world)
    dist.all_to_all_single(o, inp)
    expect("all_to_all_single", o, torch.tensor([100.0 * j + rank for j in range(world)]))
    dist.barrier()
    if world > 1:
        req = dist.isend(torch.full((9,), float(rank)), dst=(rank + 1) % world, tag=7)
        got = torch.empty(9)
        dist.recv(got, src=(rank - 1) % world, tag=7)
        req.wait()
        expect("send_recv", got, torch.full((9,), float((rank - 1) % world)))
    return res


def runloop_threads() -> int:
    """How many of gloo's worker threads (``pt_gloo_runloop``) this process still runs (Linux; -1 elsewhere)."""
    try:
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    except OSError:
        return -1
    return sum(n == "pt_gloo_runloop" for n in names)


def teardown() -> None:
    """Destroy the process group so that its threads are joined *now*, not at interpreter exit.

    ``destroy_process_group`` only drops torch's registry reference; gloo's
    worker threads stop when the C++ group is freed.  If anything still holds
    the group, they run on into interpreter finalization, and a thread that
    releases a finished work (its tensors need the GIL) is killed by the
    finalizing interpreter inside a C++ destructor: ``terminate called without
    an active exception`` (SIGABRT) after a successful run.  Two holders:
    the DDP model (the caller deletes it, and the autograd graph of its last
    output, first) and ``torch._dynamo`` (DDP's constructor imports it; imported
    *after* ``init_process_group`` it keeps the default group alive for good
    in torch 2.13, so this script imports it at the top).  The collection here
    then frees the group, whose destructor joins its threads.
    """
    dist.destroy_process_group()
    gc.collect()
    left = runloop_threads()
    if left > 0:
        print(f"warning: {left} gloo worker threads still run after destroy_process_group; something still "
              f"holds the process group", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="ltp")
    ap.add_argument("--hook", action="store_true", help="register the LTP DDP communication hook")
    ap.add_argument("--hook-transport", default=None, help="ltp | tcp (default $LTP_PS_TRANSPORT or auto)")
    ap.add_argument("--hook-schedule", default=None, help="direct | ring | rsgcm | auto (default $LTP_DDP_SCHEDULE "
                    "or auto: direct for <= 2 ranks, ring from 3)")
    ap.add_argument("--hook-min-fraction", type=float, default=None,
                    help="lossy buckets delivering less are resent reliably (1.0 = exact buckets)")
    ap.add_argument("--steps", type=int, default=12, help="optimizer steps (epochs are cycled)")
    ap.add_argument("--samples", type=int, default=250)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--d-in", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0)
    ap.add_argument("--find-unused", action="store_true")
    ap.add_argument("--accumulate", type=int, default=1, help="micro-batches per step (no_sync on all but the last)")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--timeout", type=float, default=60.0, help="process group timeout, seconds")
    ap.add_argument("--check-collectives", action="store_true")
    ap.add_argument("--out", default=None, help="directory for per-rank results")
    ap.add_argument("--die-rank", type=int, default=-1)
    ap.add_argument("--die-step", type=int, default=-1)
    args = ap.parse_args(argv)

    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    result: dict = {"rank": rank, "world": world, "backend": args.backend, "hook": args.hook}

    if args.check_collectives:
        res = check_collectives(rank, world)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            torch.save(res, os.path.join(args.out, f"coll_rank{rank}.pt"))
        print(f"rank {rank}: {len(res)} collective results correct on {args.backend}", flush=True)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.samples, args.d_in, generator=g)
    w_true = torch.randn(args.d_in, 1, generator=g)
    y = torch.tanh(x @ w_true) + 0.05 * torch.randn(args.samples, 1, generator=g)
    sampler = DistributedSampler(TensorDataset(x, y), shuffle=True, seed=0, drop_last=False)
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch, sampler=sampler)

    net = Net(args.d_in, args.hidden, args.depth, args.find_unused)
    model = DDP(net, bucket_cap_mb=args.bucket_cap_mb, find_unused_parameters=args.find_unused)
    hook_state = None
    if args.hook:
        import ltp_ps.ddp

        kw = {} if args.hook_min_fraction is None else {"min_fraction": args.hook_min_fraction}
        hook_state = ltp_ps.ddp.register(model, transport=args.hook_transport, timeout_s=args.timeout,
                                         schedule=args.hook_schedule, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    losses, step, epoch, micro = [], 0, 0, 0
    t0 = time.monotonic()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            micro += 1
            last = micro % args.accumulate == 0
            use_side = step % 2 == 0
            if last:
                out = model(xb, use_side)
            else:
                with model.no_sync():
                    out = model(xb, use_side)
            loss = nn.functional.mse_loss(out, yb) / args.accumulate
            if rank == args.die_rank and step == args.die_step:
                print(f"rank {rank}: dying in the middle of step {step}", flush=True)
                os._exit(3)
            if last:
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item() * args.accumulate)
                step += 1
                if step >= args.steps:
                    break
            else:
                with model.no_sync():
                    loss.backward()
        epoch += 1
    result.update(losses=losses, seconds=time.monotonic() - t0, steps=step)
    if hook_state is not None:
        result["hook_stats"] = hook_state.stats.as_dict()
    # the loss curve averaged over ranks (one more all-reduce): finite, and lower at the end than at the start
    curve = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(curve)
    curve = (curve / world).tolist()
    result["mean_losses"] = curve
    k = max(1, len(curve) // 3)
    ok = all(math.isfinite(v) for v in curve) and len(losses) == args.steps
    ok = ok and (args.steps < 6 or sum(curve[-k:]) < sum(curve[:k]))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        torch.save({k: v.detach().clone() for k, v in net.state_dict().items()},
                   os.path.join(args.out, f"rank{rank}.pt"))
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    print(f"rank {rank}: {args.backend}{' + hook' if args.hook else ''}: mean loss {curve[0]:.4f} -> {curve[-1]:.4f} "
          f"in {step} steps, {result['seconds']:.1f} s", flush=True)
    if hook_state is not None:
        hook_state.close()
    del model, opt, net, out, loss  # DDP and the autograd graph (hooks -> reducer) hold the process group
    teardown()
    if not ok:
        print(f"rank {rank}: training failed (mean loss curve {curve})", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
