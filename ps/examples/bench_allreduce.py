"""Time ``dist.all_reduce`` of one large float32 tensor on a backend (``gloo`` or ``ltp``), or a DDP step.

Under torchrun (or with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set)::

    torchrun --nproc-per-node 4 -m ltp_ps.examples.bench_allreduce --backend ltp --mb 100 --reps 3
    torchrun --nproc-per-node 4 -m ltp_ps.examples.bench_allreduce --backend gloo --ddp --hook --mb 100
    torchrun --nproc-per-node 4 -m ltp_ps.examples.bench_allreduce --backend ltp --schedule direct --mb 100

``--ddp`` times whole DDP steps of a one-layer model with ``--mb`` MB of
parameters in one bucket (``--hook`` routes the bucket through the LTP hook,
loss-tolerant; ``--hook-schedule`` picks its reduction: ``direct`` = bucket
server on rank 0, ``ring``/``rsgcm`` = PS-less).  ``--schedule`` is the ``ltp``
backend's all-reduce schedule (``LTP_PG_SCHEDULE``).  Rank 0 prints one line ``RESULT {json}`` with every
repetition's seconds (the slowest rank's) and checks the all-reduce result
exactly; the exit status is non-zero if it is wrong.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import torch
import torch._dynamo  # noqa: F401  (before init_process_group: see ddp_backend.teardown)
import torch.distributed as dist

import ltp_ps  # noqa: F401  (registers the "ltp" backend)
import ltp_ps.backend


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="ltp")
    ap.add_argument("--mb", type=float, default=100.0, help="tensor size, MB (10^6 bytes)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--ddp", action="store_true", help="time DDP steps instead of a bare all_reduce")
    ap.add_argument("--hook", action="store_true", help="with --ddp: the LTP gradient hook")
    ap.add_argument("--hook-min-fraction", type=float, default=None)
    ap.add_argument("--hook-schedule", default=None, help="direct | ring | rsgcm | auto (the hook's reduction)")
    ap.add_argument("--schedule", default=None, help="auto | direct | ring | rsgcm (the ltp backend's all-reduce)")
    args = ap.parse_args(argv)
    if args.schedule is not None:
        ltp_ps.backend.configure(schedule=args.schedule)
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    n = int(args.mb * 1e6) // 4
    times, ok, extra = [], True, {}
    if not args.ddp:
        x = torch.empty(n)
        for i in range(args.reps + 1):
            x.fill_(float(rank + 1))
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if i:
                times.append(dt.item())
            ok = ok and bool((x == float(world * (world + 1) // 2)).all())
    else:
        side = int(n ** 0.5)
        model = torch.nn.Linear(side, side, bias=False)
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.mb * 1.1)
        state = None
        if args.hook:
            from ltp_ps import ddp as ltp_ddp

            kw = {} if args.hook_min_fraction is None else {"min_fraction": args.hook_min_fraction}
            state = ltp_ddp.register(ddp, timeout_s=args.timeout, schedule=args.hook_schedule, **kw)
            extra["hook_schedule"] = "direct" if type(state).__name__ == "LtpHookState" else state.schedule
        xb = torch.randn(1, side)
        for i in range(args.reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            ddp(xb).sum().backward()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if i:
                times.append(dt.item())
            model.weight.grad = None
        if state is not None:
            extra["hook_stats"] = state.stats.as_dict()
            state.close()
        del ddp, model, xb
    pg = dist.group.WORLD
    if isinstance(pg, ltp_ps.backend.LtpProcessGroup):
        extra["schedule"] = pg.schedule
    del pg
    if rank == 0:
        print("RESULT " + json.dumps({"backend": args.backend, "ddp": args.ddp, "hook": args.hook, "world": world,
                                      "mb": args.mb, "seconds": times, "correct": ok, **extra}), flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
