"""The worker: pull parameters from every shard, compute, push gradients (ps-lite's KVWorker).

Loop (same for BSP and asynchronous mode; the PS decides the pace)::

    pull     one parameter message from each shard, in parallel (reliable)
             STOP from any shard -> return
    feedback the bubble table names the element ranges of *our* previous
             push that the PS did not receive -> error feedback residual
    compute  gradient at those parameters on the next local batch (in a
             thread, so the event loop keeps serving the transport)
    push     header | gradient slice to each shard, loss-tolerant, critical =
             header + first/last element of every tensor (tag = iteration)

``push``/``pull`` are also public coroutines returning reports, the
request-tracking layer of ps-lite (our futures are asyncio awaitables).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Sequence

import numpy as np

from .aggregate import critical_ranges
from .errors import PeerGone, RemoteError, TransportError, TransportTimeout
from .feedback import ErrorFeedback
from .schedule import DirectSchedule, Schedule
from .schedules import World, create as create_schedule
from .schedules.executor import Executor, Slots
from .schedules.program import Program, server as server_node, worker as worker_node
from .tree_views import MAX_RETURNS
from .transport.base import TIMEOUT, Transport
from .wire import (BUBBLE_BYTES, ELEM, HEADER_BYTES, KIND_STOP, READY_BYTES, GradHeader, ParamsHeader,
                   decode_bubbles, params_message_capacity)
from .workloads import Workload, set_flat


@dataclasses.dataclass(frozen=True)
class ShardRef:
    """Where a shard lives and which contiguous range of the model it owns."""

    shard: int
    addr: tuple
    lo: int
    hi: int


@dataclasses.dataclass
class WorkerConfig:
    rank: int
    world_size: int
    error_feedback: bool = False
    pull_timeout_s: float = 60.0  # seconds without parameters before giving up
    push_timeout_s: float | None = 30.0
    edge_elems: int = 1  # critical elements at each end of every tensor
    max_critical_ranges: int = 128  # LTP fits at most 160 ranges in a registration
    seed: int = 0
    max_iterations: int | None = None  # stop after this many pushes (tests: simulate a crash)
    max_missed: int = 3  # tree schedules: rounds in a row a tree peer may miss before it is a suspect
    max_returns: int = MAX_RETURNS  # tree schedules: times this worker, declared dead while alive, may come back


class Worker:
    def __init__(self, workload: Workload, transport: Transport, shards: Sequence[ShardRef], config: WorkerConfig,
                 *, schedule: Schedule | None = None, planner=None):
        self.workload = workload
        self.transport = transport
        self.shards = sorted(shards, key=lambda s: s.shard)
        self.cfg = config
        self.schedule = schedule or DirectSchedule()  # legacy seam (kept for callers); rounds use the planner
        self.n = workload.n_params
        self.model = workload.build_model()
        self.flat = np.zeros(self.n, dtype=np.float32)
        self.stale_param_slices = 0  # tree schedules: shard slices computed on an earlier round's parameters
        self.orphan_rounds = 0  # tree schedules: rounds skipped because a tree ancestor was dead
        self.out_rounds = 0  # tree schedules: rounds stepped through while declared dead (until taken back)
        self.returns = 0  # tree schedules: times this worker was declared dead and came back
        self.empty_relays = 0  # tree schedules: parameter relays sent empty (this worker had no whole copy)
        self.short_partial_rounds = 0  # tree schedules: rounds this aggregator went up without a child's partial
        self.relay_budget_s: float | None = None  # tree schedules: seconds a parameter relay may take (last bound)
        self.tree_board = None  # tree schedules: where views of dead workers are agreed (ltp_ps.tree_views)
        self.join_tickets: dict[int, int] = {}  # shard -> ticket of this incarnation's join (ControlChannel epoch)
        self.start_round = 0  # the round a round-program worker starts at (the PS's round when it was admitted)
        self._in = [np.zeros(params_message_capacity(s.hi - s.lo), dtype=np.uint8) for s in self.shards]
        self._out = [np.zeros(HEADER_BYTES + ELEM * (s.hi - s.lo), dtype=np.uint8) for s in self.shards]
        layout = workload.layout()
        self._critical = [critical_ranges(layout, header_bytes=HEADER_BYTES, shard=(s.lo, s.hi),
                                          edge_elems=config.edge_elems, max_ranges=config.max_critical_ranges)
                          for s in self.shards]
        self.feedback = ErrorFeedback(self.n) if config.error_feedback else None
        # The round plan and the executor: pull, compute and push are this worker's program (ltp_ps.schedules).
        self.planner = planner or create_schedule("direct", World(
            workers=range(config.world_size), n_elems=self.n, shards=tuple((s.lo, s.hi) for s in self.shards),
            layout=tuple(layout)), edge_elems=config.edge_elems, max_critical_ranges=config.max_critical_ranges)
        self.node = worker_node(config.rank)
        self.executor = Executor(transport, self.node, {server_node(s.shard): tuple(s.addr) for s in self.shards},
                                 timeout_s=config.push_timeout_s or 1e9,
                                 payload_timeouts={"params": config.pull_timeout_s})
        self.slots = Slots()
        note = np.zeros(READY_BYTES, dtype=np.uint8)
        for s, buf, out, crit in zip(self.shards, self._in, self._out, self._critical):
            self.slots.bind(f"params:{server_node(s.shard)}", buf)
            self.slots.bind(f"out:{server_node(s.shard)}", out)
            self.slots.bind_critical(f"out:{server_node(s.shard)}", crit)
            self.slots.bind(f"note:{server_node(s.shard)}", note)
        self._batches = None
        self.iterations = 0
        self.last_loss = float("nan")
        self.pushes: list = []

    async def pull(self) -> list[ParamsHeader]:
        """Receive one parameter message per shard; parameters land in ``self.flat``."""
        res = await self.executor.run(self.planner.worker_program(self.cfg.rank, 0).head(1), self.slots)
        for s, r in zip(self.shards, res.reports):
            if not r.complete:
                # nothing, or a transfer cut short (the PS dropped us mid-broadcast: its sender gave up and the
                # receiver zero-filled the rest, so even with the header in, these are not the parameters)
                why = ("no parameters" if r.received_bytes == 0 and r.regime == TIMEOUT else
                       f"the parameter transfer ended incomplete ({r.regime}, {r.received_bytes} of "
                       f"{r.total_bytes} bytes, header {'in' if r.critical_complete else 'missing'})")
                raise TransportTimeout(f"worker {self.cfg.rank}: {why} from PS shard {s.shard} at {s.addr} within "
                                       f"{self.cfg.pull_timeout_s} s")
        headers = []
        for s, buf, r in zip(self.shards, self._in, res.reports):
            h = ParamsHeader.unpack(buf)
            if h.kind != KIND_STOP and h.n_elems != s.hi - s.lo:
                raise RemoteError(f"shard {s.shard} sent {h.n_elems} parameters, expected {s.hi - s.lo}")
            headers.append(h)
        if any(h.kind == KIND_STOP for h in headers):
            return headers
        its = {h.iteration for h in headers}
        if len(its) != 1:
            raise RemoteError(f"shards are at different iterations {sorted(its)}; BSP shards must advance together")
        for s, buf, h in zip(self.shards, self._in, headers):
            self.flat[s.lo:s.hi] = buf[HEADER_BYTES:HEADER_BYTES + ELEM * h.n_elems].view(np.float32)
            if self.feedback is not None and h.n_bubbles:
                off = HEADER_BYTES + ELEM * h.n_elems
                mine = decode_bubbles(buf[off:off + BUBBLE_BYTES * h.n_bubbles], h.n_bubbles).get(self.cfg.rank, [])
                if mine:
                    self.feedback.lost_shard(h.iteration - 1, [(s.lo + a, s.lo + b) for a, b in mine])
        if self.feedback is not None:
            self.feedback.commit()
        return headers

    async def push(self, grad: np.ndarray, *, iteration: int, model_version: int, loss: float, samples: int,
                   compute_s: float = 0.0) -> list:
        """Send ``grad`` (full model) to every shard; returns the SendReports."""
        for s, out in zip(self.shards, self._out):
            GradHeader(self.cfg.rank, s.shard, iteration, model_version, samples, loss, compute_s).pack_into(out)
            out[HEADER_BYTES:].view(np.float32)[:] = grad[s.lo:s.hi]
        prog = self.planner.worker_program(self.cfg.rank, iteration)
        push = Program(self.node, prog.stages[2:])
        res = await self.executor.run(push, self.slots, iteration=iteration)
        steps = push.steps()
        out = []
        for st, r in zip(steps, res.reports):
            if isinstance(r, BaseException):
                raise r
            if st.payload == "grad":
                out.append(r)
        return out

    async def run(self) -> dict:
        """Train until the PS says STOP.  Returns a small stats dict."""
        from .dynamic_roles import runs_async_controller, worker_run as controller_worker_run

        if runs_async_controller(self.planner):  # mlfabric: the PS's controller grants every transfer
            return await controller_worker_run(self)
        if getattr(self.planner, "name", None) == "hoplite":  # the PS's Hoplite directory grants every transfer
            from .hoplite_roles import worker_run as hoplite_worker_run

            return await hoplite_worker_run(self)
        if not hasattr(self.planner, "worker_program"):  # trees etc.: run the schedule's whole round program
            from .program_roles import worker_run

            return await worker_run(self, self.start_round)
        if self._batches is None:
            self._batches = self.workload.batches(self.cfg.rank, self.cfg.world_size, self.cfg.seed)
        while True:
            t_pull = time.monotonic()
            try:
                headers = await self.pull()
            except TransportTimeout as exc:
                raise TransportTimeout(
                    f"worker {self.cfg.rank}: no parameters from the PS for {time.monotonic() - t_pull:.1f} s "
                    f"(--pull-timeout {self.cfg.pull_timeout_s:g} s; {exc}); the PS may have dropped this worker "
                    f"(raise --max-missed / --gather-timeout) or exited") from exc
            if any(h.kind == KIND_STOP for h in headers):
                return {"iterations": self.iterations, "last_loss": self.last_loss, "stopped": True}
            h = headers[0]
            if self.model is not None:
                set_flat(self.model, self.flat)
            batch = await asyncio.to_thread(next, self._batches)  # a batch can be seconds of work (synthetic 100+ MB)
            t0 = time.monotonic()
            grad, loss, samples = await asyncio.to_thread(self.workload.compute, self.model, batch)
            compute_s = time.monotonic() - t0
            if self.feedback is not None:
                grad = self.feedback.compensate(grad, h.iteration)
            t_push = time.monotonic()
            try:
                reps = await self.push(grad, iteration=h.iteration, model_version=h.model_version, loss=loss,
                                       samples=samples, compute_s=compute_s)
            except (TransportError, ConnectionError) as exc:
                if isinstance(exc, PeerGone):
                    # the PS's socket is gone (it exited, or died and restarts): waiting --pull-timeout for its next
                    # round would only delay the caller, which asks the store whether the job ended or a new
                    # incarnation is up (seen: a worker SIGSTOPped past the end of the job hung on for 60 s)
                    raise
                # A gradient is loss-tolerant: a failed push costs this round (the PS counts it as missed),
                # not the job. A PS that is really gone shows up in the next pull (or as a new incarnation).
                print(f"[worker {self.cfg.rank}] push of round {h.iteration} failed after "
                      f"{time.monotonic() - t_push:.2f} s ({type(exc).__name__}: {exc}); pulling the next round",
                      flush=True)
                reps = []
            self.pushes.append([r.delivered_fraction for r in reps] or [0.0] * len(self.shards))
            self.iterations += 1
            self.last_loss = loss
            if self.cfg.max_iterations is not None and self.iterations >= self.cfg.max_iterations:
                return {"iterations": self.iterations, "last_loss": loss, "stopped": False}
