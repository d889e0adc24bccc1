"""PyTorch drop-in: a DDP communication hook that averages gradient buckets through a PS over LTP.

One added line switches an existing DDP script (gloo on CPU is fine)::

    model = DistributedDataParallel(net)
    ltp_ps.ddp.register(model)            # <- the only LTP line

How it works
------------
* ``register`` reads rank and world size from the process group and uses the
  group's own store (the TCPStore torchrun / ``init_process_group`` created)
  for rendezvous under the prefix ``ltp_ps_ddp/``: rank 0 lazily starts an
  aggregation PS (:class:`BucketServer`) on a background event-loop thread of
  its own process; every rank (rank 0 included) opens a transport endpoint on
  that thread and publishes its address.
* The hook runs for every bucket in bucket order (DDP's reducer launches hooks
  in index order on every rank, so a per-process round counter names the same
  bucket everywhere).  Each bucket goes to the PS loss-tolerantly with the
  header and the first/last element of every parameter critical; the PS
  gathers all ranks with one Early Close deadline, takes the unbiased (or
  zero-filled) mean and broadcasts it back reliably; the hook's
  ``torch.futures.Future`` resolves to the averaged bucket.
* No optimizer runs at this PS: DDP's local optimizers stay in charge, exactly
  as with allreduce.

Transport: ``transport="auto"`` (default, or ``$LTP_PS_TRANSPORT``) uses LTP
when ``ltp.open_endpoint`` exists and TCP otherwise, and says which on rank 0.
The job secret is ``$LTP_PS_SECRET`` if set; otherwise the process group's
store (already shared by exactly this job) is the trust anchor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from .aggregate import Aggregator, bubbles_to_elements, limit_ranges
from .errors import ConfigError, RemoteError
from .schedule import DirectSchedule
from .transport import open_transport, resolve_kind
from .wire import ELEM, HEADER_BYTES, KIND_GRAD, KIND_PARAMS, GradHeader, ParamsHeader, tag_of


class _LoopThread:
    """An asyncio loop on a daemon thread; ``submit`` returns a concurrent future."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro, timeout=None):
        return self.submit(coro).result(timeout)


class BucketServer:
    """Aggregation-only PS for DDP buckets: gather round r from all ranks, mean, broadcast back."""

    def __init__(self, transport, peers: list, max_elems: int, *, aggregation: str = "unbiased",
                 gather_timeout_s: float = 60.0):
        self.transport = transport
        self.peers = [tuple(p) for p in peers]
        self.max_elems = max_elems
        self.aggregation = aggregation
        self.gather_timeout_s = gather_timeout_s
        self.bufs = [np.zeros(HEADER_BYTES + ELEM * max_elems, dtype=np.uint8) for _ in peers]
        self.out = np.zeros(HEADER_BYTES + ELEM * max_elems, dtype=np.uint8)
        self.round = 0
        self.schedule = DirectSchedule()
        self.delivered: list[list[float]] = []
        self._aggs: dict[int, Aggregator] = {}

    async def serve_forever(self) -> None:
        while True:
            await self.serve_round()

    async def serve_round(self) -> None:
        r = self.round
        # READY notes first, then one Early Close gather (see DirectSchedule.server_gather)
        reps = await self.schedule.server_gather(self.transport, self.peers, self.bufs, tag=tag_of(r, KIND_GRAD),
                                                 timeout=self.gather_timeout_s)
        n, index = None, 0
        contribs = []
        for buf, rep in zip(self.bufs, reps):
            h = GradHeader.unpack(buf) if rep.received_bytes else None
            if h is None or h.iteration != r or not rep.critical_complete:
                continue
            if n is not None and h.samples != n:
                raise RemoteError(f"DDP bucket {h.shard} has {h.samples} elements on rank {h.rank}, {n} elsewhere")
            n, index = h.samples, h.shard
            contribs.append((buf, rep))
        self.delivered.append([rep.delivered_fraction for rep in reps])
        self.round += 1
        if n is None:
            return  # nobody delivered; ranks time out and raise
        agg = self._aggs.get(n)
        if agg is None:
            agg = self._aggs[n] = Aggregator(n, self.aggregation)
        agg.reset()
        for buf, rep in contribs:
            agg.add(buf[HEADER_BYTES:HEADER_BYTES + ELEM * n].view(np.float32),
                    bubbles_to_elements(rep.bubbles, offset=HEADER_BYTES, n_elems=n))
        ParamsHeader(KIND_PARAMS, index, r, r, n, 0).pack_into(self.out)
        agg.result(out=self.out[HEADER_BYTES:HEADER_BYTES + ELEM * n].view(np.float32))
        await self.transport.broadcast(self.peers, memoryview(self.out)[:HEADER_BYTES + ELEM * n],
                                       tag=tag_of(r, KIND_PARAMS), timeout=self.gather_timeout_s)


@dataclasses.dataclass
class LtpHookState:
    rank: int
    world_size: int
    transport_kind: str
    max_elems: int
    timeout_s: float
    runner: _LoopThread = None
    transport: object = None
    ps_addr: tuple = None
    server: BucketServer | None = None
    round: int = 0
    delivered: list = dataclasses.field(default_factory=list)

    async def exchange(self, r: int, index: int, grads: np.ndarray, critical: list) -> np.ndarray:
        n = grads.size
        msg = np.empty(HEADER_BYTES + ELEM * n, dtype=np.uint8)
        GradHeader(self.rank, index, r, r, n, 0.0).pack_into(msg)
        msg[HEADER_BYTES:].view(np.float32)[:] = grads
        rep = await DirectSchedule().worker_push(self.transport, self.ps_addr, msg, critical=critical,
                                                 tag=tag_of(r, KIND_GRAD), timeout=self.timeout_s)
        self.delivered.append(rep.delivered_fraction)
        back = np.empty(HEADER_BYTES + ELEM * n, dtype=np.uint8)
        await self.transport.recv(back, peer=self.ps_addr, tag=tag_of(r, KIND_PARAMS), timeout=self.timeout_s)
        h = ParamsHeader.unpack(back)
        if h.n_elems != n or h.iteration != r:
            raise RemoteError(f"bucket round {r}: PS answered round {h.iteration} with {h.n_elems} elements "
                              f"(expected {n}); ranks disagree on the bucket layout")
        return back[HEADER_BYTES:].view(np.float32)

    def close(self) -> None:
        if self.transport is not None:
            self.runner.call(self.transport.close(), 10)
        if self.server is not None:
            self.runner.call(self.server.transport.close(), 10)
        self.runner.loop.call_soon_threadsafe(self.runner.loop.stop)


def ltp_hook(state: LtpHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket`` over all ranks through the PS."""
    buf = bucket.buffer()
    fut: torch.futures.Future = torch.futures.Future()
    if buf.dtype != torch.float32:
        fut.set_exception(ConfigError(f"ltp_hook handles float32 buckets, got {buf.dtype}; "
                                      "train in float32 or cast gradients"))
        return fut
    grads = buf.detach().reshape(-1).numpy()
    ends, off = [], 0
    for p in bucket.parameters():
        ends += [(off, off + 1), (off + p.numel() - 1, off + p.numel())]
        off += p.numel()
    critical = limit_ranges([(0, HEADER_BYTES)] + [(HEADER_BYTES + ELEM * a, HEADER_BYTES + ELEM * b)
                                                  for a, b in ends if b <= grads.size], 128)
    r = state.round
    state.round += 1
    cf = state.runner.submit(state.exchange(r, bucket.index(), grads, critical))

    def done(f):
        exc = f.exception()
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(torch.from_numpy(f.result().copy()).view_as(buf))

    cf.add_done_callback(done)
    return fut


# DDP checks the annotation object itself; ``from __future__ import annotations`` made it a string.
ltp_hook.__annotations__.update(bucket=dist.GradBucket, state=LtpHookState, **{"return": torch.futures.Future[torch.Tensor]})


def register(ddp_model, *, transport: str | None = None, cc: str = "cubic", aggregation: str = "unbiased",
             host: str | None = None, timeout_s: float = 120.0, process_group=None) -> LtpHookState:
    """Route ``ddp_model``'s gradient buckets through an LTP parameter server; returns the hook state."""
    if not dist.is_initialized():
        raise ConfigError("ltp_ps.ddp.register: call torch.distributed.init_process_group first")
    pg = process_group or dist.group.WORLD
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    kind = resolve_kind(transport or os.environ.get("LTP_PS_TRANSPORT", "auto"))
    host = host or os.environ.get("LTP_PS_HOST", "127.0.0.1")
    secret = os.environ.get("LTP_PS_SECRET", "").encode() or None
    store = dist.PrefixStore("ltp_ps_ddp/", dist.distributed_c10d._get_default_store())
    max_elems = sum(p.numel() for p in ddp_model.parameters() if p.requires_grad)
    state = LtpHookState(rank, world, kind, max_elems, timeout_s, runner=_LoopThread(f"ltp-ddp-{rank}"))

    async def open_ep():
        return await open_transport(kind, host, 0, cc=cc if kind == "tcp" else None, job_key=secret,
                                    advertise_host=os.environ.get("LTP_PS_ADVERTISE"))

    state.transport = state.runner.call(open_ep(), 30)
    store.set(f"addr/{rank}", f"{state.transport.local_addr[0]}:{state.transport.local_addr[1]}")
    if rank == 0:
        ps_t = state.runner.call(open_ep(), 30)
        store.wait([f"addr/{r}" for r in range(world)])
        peers = []
        for r in range(world):
            h, _, p = store.get(f"addr/{r}").decode().rpartition(":")
            peers.append((h, int(p)))
        state.server = BucketServer(ps_t, peers, max_elems, aggregation=aggregation, gather_timeout_s=timeout_s)
        state.runner.submit(state.server.serve_forever())
        store.set("ps", f"{ps_t.local_addr[0]}:{ps_t.local_addr[1]}")
        print(f"ltp_ps.ddp: gradient buckets of {world} ranks averaged by a PS at {ps_t.local_addr} over "
              f"{kind}{'/' + cc if kind == 'tcp' else ''} ({aggregation} mean)", flush=True)
    store.wait(["ps"])
    h, _, p = store.get("ps").decode().rpartition(":")
    state.ps_addr = (h, int(p))
    ddp_model.register_comm_hook(state, ltp_hook)
    return state
