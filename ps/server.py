"""The PS shard: BSP rounds (gather -> aggregate -> optimizer -> broadcast) or asynchronous updates.

Theory of operation (BSP)
-------------------------
One round ``i`` of shard ``s``::

    poll joins        admit workers whose join request verified (rendezvous)
    broadcast(i)      reliable: header(i, version) | params | bubbles of round i-1
                      a failed send drops that worker (its process is gone)
    gather(i)         loss-tolerant, one Early Close deadline for all active workers,
                      bounded by ``gather_timeout_s`` or, by default, by the bound
                      ``ltp_ps.deadlines`` derives from size and measured rates; a
                      worker that delivers nothing is "missed" and dropped after
                      ``max_missed`` misses in a row
    combine           schedule.combine -> unbiased or zero-filled mean
    optimizer step    in place on the broadcast buffer; version += 1
    metrics, checkpoint every ``checkpoint_every`` rounds (atomic)
    health            a non-finite loss or parameter, ``max_missed`` rounds in a row
                      without one applied update, or no live worker left (none
                      rejoins within ``join_timeout_s``) raise TrainingFailed:
                      the job never reports success when nothing trained
    verdict           after the last round, before STOP: a model that ends at
                      chance accuracy (collapsed, or never trained) raises
                      TrainingFailed too (``ltp_ps.verdict``)

Timeouts: the gather bound and the reliable broadcast's bound are both derived
each round from the message size and the measured link rate
(``ltp_ps.deadlines``); ``gather_timeout_s`` / ``broadcast_timeout_s`` fix them.

Workers run the mirror loop (``ltp_ps.worker``): pull(i) -> compute -> push(i).
A worker that joins late, or restarts and rejoins, receives the current
parameters with the next broadcast.  After the last round every active worker
gets a STOP message.

Asynchronous mode: one task per worker loops ``send params -> recv gradient
-> apply`` independently; every gradient is applied on arrival and its
staleness (PS version now minus the version it was computed on) is recorded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from typing import Callable

import numpy as np

from .aggregate import Aggregator, feedback_ranges
from .checkpoint import load_latest, save_checkpoint
from .deadlines import GatherDeadline
from .errors import ConfigError, RendezvousError, TrainingFailed
from .membership import Membership, Staleness
from .metrics import MetricsLog, epoch_loss, figure, format_summary, summarize, sync_s
from .optim import CLIP_FACTOR, FlatOptimizer, NormGuard
from .schedule import DirectSchedule, Schedule
from .schedules import World, create as create_schedule
from .schedules.executor import Executor, Slots
from .schedules.program import RELIABLE, Program, Send, server as server_node, worker as worker_node
from . import sharded_eval
from .sharding import ShardPlan
from .verdict import AccuracyVerdict
from .tree_views import MAX_RETURNS
from .transport.base import CANCELLED, TIMEOUT, Transport
from .wire import (ELEM, HEADER_BYTES, KIND_PARAMS, KIND_STOP, MAX_BUBBLES, READY_BYTES, ParamsHeader,
                   encode_bubbles, params_message_capacity, tag_of)
from .workloads import Workload


@dataclasses.dataclass
class ServerConfig:
    world_size: int  # workers the job expects
    epochs: int = 1
    iterations: int | None = None  # overrides epochs * iters_per_epoch
    mode: str = "bsp"  # "bsp" | "async"
    aggregation: str = "unbiased"  # | "zero_fill"
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    clip_factor: float = CLIP_FACTOR  # divergence guard: clip the aggregate's norm to this x its running mean (0: off)
    gather_timeout_s: float | None = None  # seconds; None: derived per round (ltp_ps.deadlines)
    broadcast_timeout_s: float | None = None  # seconds; None: derived per round (ltp_ps.deadlines)
    max_missed: int = 3
    max_returns: int = MAX_RETURNS  # tree schedules: times a worker declared dead while alive may come back (--max-returns)
    min_workers: int | None = None  # BSP starts when this many joined (default: world_size)
    join_timeout_s: float = 120.0  # seconds to wait for workers to (re)join
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # rounds; 0 = only at the end
    metrics_path: str | None = None
    evaluate: bool = True
    progress: bool = False  # tqdm bar on stderr
    seed: int = 0

    def __post_init__(self):
        if self.mode not in ("bsp", "async"):
            raise ConfigError(f"unknown mode {self.mode!r}; use bsp or async")
        if self.world_size < 1:
            raise ConfigError("--workers must be >= 1")


class ParameterServer:
    """One PS shard.  ``admit()`` directly, or pass a ``rendezvous`` to admit through the store."""

    def __init__(self, workload: Workload, transport: Transport, config: ServerConfig, *,
                 plan: ShardPlan | None = None, shard: int = 0, schedule: Schedule | None = None,
                 rendezvous=None, log: Callable[[str], None] | None = None, planner=None):
        self.workload = workload
        self.transport = transport
        self.cfg = config
        self.plan = plan or ShardPlan(workload.n_params, 1)
        self.shard = shard
        self.lo, self.hi = self.plan.ranges[shard]
        self.n = self.hi - self.lo
        self.schedule = schedule or DirectSchedule()  # maths on raw gradient messages (contribution/combine)
        # The round plan (ltp_ps.schedules) and the executor that runs it: nothing here sends around it.
        self.planner = planner or create_schedule("direct", World(
            workers=range(config.world_size), n_elems=workload.n_params, shards=tuple(self.plan.ranges),
            layout=tuple(workload.layout()), aggregation=config.aggregation))
        self.node = server_node(shard)
        self.deadline = GatherDeadline(config.gather_timeout_s, broadcast_fixed_s=config.broadcast_timeout_s)
        bt = self.deadline.broadcast_timeout(params_message_capacity(self.n), config.world_size)
        self.executor = Executor(transport, self.node, {}, timeout_s=bt, payload_timeouts={"params": bt, "stop": bt})
        self._slots = Slots()
        self._ready_wait: float | None = None
        self.rendezvous = rendezvous
        self.tree_board = None  # tree schedules: where views of dead workers are agreed (ltp_ps.tree_views)
        self.log = log or (lambda s: print(s, flush=True))
        self.membership = Membership(max_missed=config.max_missed)
        self.join_tickets: dict[int, int] = {}  # rank -> ticket of its latest admitted join (ControlChannel epoch)
        self.staleness = Staleness()
        self.aggregator = Aggregator(self.n, config.aggregation)
        # The broadcast buffer: header | params | bubble table; params are optimized in place.
        self._msg = np.zeros(params_message_capacity(self.n), dtype=np.uint8)
        self.params = self._msg[HEADER_BYTES:HEADER_BYTES + ELEM * self.n].view(np.float32)
        self.params[:] = workload.initial_params(config.seed)[self.lo:self.hi]
        self.optimizer = FlatOptimizer(self.params, config.optimizer, lr=config.lr, momentum=config.momentum,
                                       weight_decay=config.weight_decay)
        self.guard = NormGuard(config.clip_factor)
        self._clip_scale = 1.0
        self.iteration = 0
        self.version = 0
        self.ipe = max(1, workload.iters_per_epoch(config.world_size))
        self.total = config.iterations if config.iterations is not None else config.epochs * self.ipe
        self.epochs_total = -(-self.total // self.ipe)
        self._bufs: dict[int, np.ndarray] = {}
        self._lost_prev: dict[int, list] = {}
        self.metrics = MetricsLog(config.metrics_path)
        self.epoch_lines: list[str] = []
        self._stopping = False
        self._ready_note = np.zeros(READY_BYTES, dtype=np.uint8)
        self.verdict = AccuracyVerdict(getattr(workload, "chance_accuracy", None))
        self._empty_rounds = 0  # consecutive rounds without one usable gradient
        self._last_applied = True  # the latest round applied an update (checked at the end of a BSP run)
        self._failed: TrainingFailed | None = None
        self._resume()

    # -- membership ------------------------------------------------------
    def admit(self, rank: int, addr: tuple, ticket: int = 0) -> None:
        """Admit worker ``rank`` at ``addr``; ``ticket``: its join request's (``rdv.join``), 0 without a store."""
        m = self.membership.admit(rank, addr, self.iteration)
        self.join_tickets[rank] = int(ticket)
        self._bufs.setdefault(rank, np.zeros(HEADER_BYTES + ELEM * self.n, dtype=np.uint8))
        self.metrics.write({"event": "join", "t": time.time(), "rank": rank, "addr": list(addr),
                            "generation": m.generation, "iteration": self.iteration})

    def _poll(self) -> None:
        if self.rendezvous is None:
            return
        accepted, rejected = self.rendezvous.poll(self.iteration)
        for req in accepted:
            self.admit(int(req["rank"]), tuple(req["addr"]), int(req.get("ticket", 0)))
        for rank, reason in rejected:
            self.log(f"[ps{self.shard}] refused worker {rank}: {reason}")
            self.metrics.write({"event": "refused", "t": time.time(), "rank": rank, "reason": reason})

    def returning_workers(self, channels) -> list:
        """Controller-driven PS loops (hoplite, mlfabric): poll the store, then every active member whose control
        streams must start afresh -- joined again since it was written off, a restarted process (a new join ticket
        than its streams' epoch), or a first join -- as ``(node, member, joined_before)``."""
        self._poll()
        out = []
        for m in self.membership.active():
            n = worker_node(m.rank)
            ch = channels.get(n)
            if ch is None or ch.epoch != self.join_tickets.get(m.rank, 0):
                out.append((n, m, ch is not None))
        return out

    def reopen_control(self, node: str, member, channels: dict, listeners: dict, listen) -> None:
        """Fresh control streams with a returning worker (:meth:`returning_workers`): its old listener stops, its
        address is refreshed, the new channel's epoch is its join ticket, and ``listen(node)`` runs for it."""
        from .schedules.driver import DOWN, UP, ControlChannel

        old = listeners.pop(node, None)
        if old is not None:
            old.cancel()
        self._address([member])
        channels[node] = ControlChannel(self.executor, node, out_dir=DOWN, in_dir=UP,
                                        epoch=self.join_tickets.get(member.rank, 0))
        listeners[node] = asyncio.ensure_future(listen(node))

    async def _wait_workers(self, want: int) -> None:
        deadline = time.monotonic() + self.cfg.join_timeout_s
        while True:
            self._poll()
            if len(self.membership.active()) >= want:
                return
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"only {len(self.membership.active())} of {want} workers joined PS shard {self.shard} within "
                    f"{self.cfg.join_timeout_s:.0f} s; start the workers (same --store, --job, secret) or "
                    f"lower --min-workers")
            await asyncio.sleep(0.02)

    # -- checkpoints -----------------------------------------------------
    def _resume(self) -> None:
        st = load_latest(self.cfg.checkpoint_dir, self.shard, n_params=self.workload.n_params,
                         shard_range=(self.lo, self.hi))
        if st is None:
            return
        self.params[:] = st["params"].numpy()
        self.optimizer.load_state_dict(st["optimizer"])
        self.iteration, self.version = st["iteration"], st["version"]
        self.log(f"[ps{self.shard}] resumed from checkpoint at iteration {self.iteration}")

    def checkpoint(self) -> str | None:
        if not self.cfg.checkpoint_dir:
            return None
        return save_checkpoint(self.cfg.checkpoint_dir, self.shard, params=self.params,
                               optimizer_state=self.optimizer.state_dict(), iteration=self.iteration,
                               version=self.version, n_params=self.workload.n_params,
                               shard_range=(self.lo, self.hi))

    # -- messages --------------------------------------------------------
    def _params_message(self, kind: int, lost: dict, round_bound_s: float = 0.0) -> memoryview:
        table = encode_bubbles(lost, MAX_BUBBLES) if kind == KIND_PARAMS else encode_bubbles({})
        hdr = ParamsHeader(kind, self.shard, self.iteration, self.version, self.n, len(table),
                           self.iteration // self.ipe, int(round_bound_s * 1000))
        hdr.pack_into(self._msg)
        off = HEADER_BYTES + ELEM * self.n
        raw = table.view(np.uint8)
        self._msg[off:off + raw.size] = raw
        return memoryview(self._msg)[:off + raw.size]

    def _evaluate(self, epoch: int) -> dict:
        if not self.cfg.evaluate:
            return {}
        if self.plan.n_shards == 1:
            return self.workload.evaluate(self.params)
        # sharded: shard 0 evaluates the model assembled from every shard's slice (ltp_ps.sharded_eval)
        rdv = self.rendezvous
        if rdv is None or not sharded_eval.eligible(self.workload, self.workload.n_params):
            return {}
        try:
            if self.shard != 0:
                sharded_eval.publish_slice(rdv.store, rdv.secret, self.shard, epoch, self.params)
                return {}
            full, why = sharded_eval.assemble(rdv.store, rdv.secret, self.plan.ranges, self.params, epoch)
        except Exception as exc:  # the store is gone: the job is failing for that reason already
            why = f"the store failed ({exc})"
            full = None
        if full is None:
            self.log(f"[ps{self.shard}] epoch {epoch + 1}: not evaluated: {why}")
            return {}
        return self.workload.evaluate(full)

    # -- BSP ---------------------------------------------------------------
    async def run(self) -> dict:
        """Train to the end; returns the summary dict."""
        try:
            from .dynamic_roles import runs_async_controller, server_run

            if runs_async_controller(self.planner):  # mlfabric: asynchronous updates through its controller
                await server_run(self)
            elif getattr(self.planner, "name", None) == "hoplite":  # BSP rounds through Hoplite's directory
                from .hoplite_roles import server_run as hoplite_server_run

                await hoplite_server_run(self)
            elif self.cfg.mode == "async":
                await self._run_async()
            else:
                await self._run_bsp()
            self._raise_verdict()  # the modes ask before their STOP; this catches any path that did not
        except TrainingFailed as exc:
            self._failed = exc
            self.metrics.write({"event": "failed", "t": time.time(), "iteration": self.iteration,
                                "reason": str(exc)})
            if self.rendezvous is not None:
                self.rendezvous.mark_failed(str(exc))  # before STOP, so no worker reads "done" and exits 0
            await self._stop_all(best_effort=True)
            raise
        finally:
            if self._failed is None or np.isfinite(self.params).all():
                self.checkpoint()  # never overwrite a good checkpoint with diverged parameters
            self.metrics.close()
        s = summarize(self.metrics.rows)
        s["staleness_mean"] = self.staleness.mean
        s["staleness_max"] = self.staleness.max
        return s

    async def _run_bsp(self) -> None:
        await self._wait_workers(self.cfg.min_workers or self.cfg.world_size)
        bar = _bar(self.total, self.iteration, self.cfg.progress, f"ps{self.shard}")
        epoch_rows: list[dict] = []
        while self.iteration < self.total:
            self._poll()
            if not self.membership.active():
                await self._wait_rejoin()
            row = await self.round()
            epoch_rows.append(row)
            if bar is not None:
                bar.update(1)
                shown = row["loss"] if self.workload.reports_loss else None
                bar.set_postfix(loss=figure(shown, ".3f"), sync=f"{sync_s(row) * 1e3:.1f}ms")
            if self.iteration % self.ipe == 0 or self.iteration == self.total:
                self._end_epoch(epoch_rows)
                epoch_rows = []
            if self.cfg.checkpoint_every and self.iteration % self.cfg.checkpoint_every == 0:
                self.checkpoint()
        if bar is not None:
            bar.close()
        if not self._last_applied:  # every worker lost in the last round(s): the run did not finish its training
            dropped = [f"worker {e.rank}: {e.reason}" for e in self.membership.events_log if e.kind == "dropped"]
            raise TrainingFailed(
                f"PS shard {self.shard}: the last round ({self.iteration - 1}) applied no update: no usable gradient "
                f"from any of {len(self.membership.active())} live workers "
                f"({'; '.join(dropped[-8:]) or 'none dropped'}); the job did not finish its training")
        self._raise_verdict()  # before STOP, so the workers read the failure too
        await self._stop_all()

    async def round(self) -> dict:
        """One BSP round (broadcast i, gather i, update).  Returns its metrics row."""
        if not hasattr(self.planner, "server_program"):  # trees etc.: the shard runs its whole round program
            from .program_roles import server_round

            return await server_round(self)
        it = self.iteration
        members = self.membership.active()
        self.transport.discard_before(tag_of(it, 0))  # late gradients of earlier rounds
        msg = self._params_message(KIND_PARAMS, self._lost_prev)
        prog = self._bind_round(it, members, msg)
        self.executor.payload_timeouts["params"] = self.deadline.broadcast_timeout(len(msg), len(members))
        gather_prog = Program(self.node, prog.stages[1:-1])
        # a worker that has its parameters sends its gradient while the others still receive theirs: let it
        # land in its gather buffer now, rather than be copied there once the gather is posted
        await self.executor.expect(gather_prog, self._slots)
        t0 = time.monotonic()
        reps = (await self.executor.run(prog.head(1), self._slots, iteration=it)).reports
        t_b = time.monotonic() - t0
        alive = []
        for m, r in zip(members, reps):
            if isinstance(r, BaseException):
                why = f"broadcast of round {it} failed after {t_b:.2f} s: {type(r).__name__}: {r}"
                self.membership.failed(m.rank, why)
                self.log(f"[ps{self.shard}] dropped worker {m.rank}: {why}")
            else:
                alive.append(m)
        if alive and len(alive) == len(reps):
            self.deadline.observe_transfer(len(msg) * len(alive), t_b)
        bufs = [self._bufs[m.rank] for m in alive]
        gather_timeout = self.deadline.timeout(HEADER_BYTES + ELEM * self.n, len(alive))
        t1 = time.monotonic()
        gres = await self.executor.run(gather_prog, self._slots, iteration=it,
                                       exclude={worker_node(m.rank) for m in members if m not in alive},
                                       group_timeouts={"ready": gather_timeout, "grad": gather_timeout})
        idx = {worker_node(m.rank): i for i, m in enumerate(members)}
        greps = [gres.reports[len(gres.reports) - len(members) + idx[worker_node(m.rank)]] for m in alive]
        self._ready_wait = gres.group_s.get("ready")  # compute time of the slowest worker, as seen by the PS
        t_wait = time.monotonic() - t1
        contribs = []
        lost: dict = {}
        delivered: dict = {}
        regimes: dict = {}
        bubbles: dict = {}
        losses, samples, compute = [], 0, []
        for m, buf, r in zip(alive, bufs, greps):
            c = self.schedule.contribution(m.rank, buf, r, self.n)
            if c.usable and (c.header.iteration != it or c.header.rank != m.rank or c.header.shard != self.shard):
                c = dataclasses.replace(c, header=None, lost=[(0, self.n)])  # stale or misrouted
            contribs.append(c)
            delivered[m.rank] = r.delivered_fraction if c.usable else 0.0
            regimes[m.rank] = r.regime
            if c.usable:
                self.membership.delivered(m.rank)
                losses.append(c.header.loss)
                samples += c.header.samples
                compute.append(c.header.compute_s)
                if c.lost:
                    bubbles[m.rank] = len(c.lost)
            elif r.regime not in (TIMEOUT, CANCELLED):
                self.membership.delivered(m.rank)  # alive (it registered), but Early Close left nothing usable
            elif self.membership.missed(m.rank, _miss_reason(r, gather_timeout, t_wait)):
                self.log(f"[ps{self.shard}] dropped worker {m.rank}: {_miss_reason(r, gather_timeout, t_wait)} "
                         f"{self.cfg.max_missed} rounds in a row")
            if c.lost:
                lost[m.rank] = c.lost
        grad = self.schedule.combine(self.aggregator, contribs)
        version = self.version
        uncovered = self._apply(grad, it)
        # error feedback: what each worker should re-send (unbiased mean: only what nobody delivered)
        self._lost_prev = {rank: fb for rank, v in lost.items()
                           if (fb := feedback_ranges(self.cfg.aggregation, v, uncovered))}
        self.iteration += 1
        # The wait includes the workers' compute: subtract the slowest reported compute, so that broadcast_s +
        # gather_s runs from the broadcast's start to the last gradient, less compute. A TCP broadcast "ends" when
        # its last bytes are in the kernel's buffers, so their delivery is in this wait. With the READY handshake
        # the READY wait is subtracted instead, which also takes that delivery out of TCP's figure.
        ready_wait = self._ready_wait
        t_g = max(0.0, t_wait - (ready_wait if ready_wait is not None else max(compute, default=0.0)))
        row = {"event": "iteration", "t": time.time(), "shard": self.shard, "iteration": it,
               "epoch": it // self.ipe, "workers": len(alive), "contributors": self.aggregator.contributors,
               "gather_s": t_g, "gather_wait_s": t_wait, "broadcast_s": t_b,
               "compute_max_s": max(compute, default=0.0),
               "delivered": {str(k): v for k, v in delivered.items()}, "regime": {str(k): v for k, v in regimes.items()},
               "bubbles": {str(k): v for k, v in bubbles.items()},
               "lost_elements": {str(k): int(sum(e - s for s, e in v)) for k, v in lost.items()},
               "uncovered_elements": int(sum(e - s for s, e in uncovered)), "rejected": self.aggregator.rejected,
               "feedback_elements": {str(k): int(sum(e - s for s, e in v)) for k, v in self._lost_prev.items()},
               "clip_scale": self._clip_scale,
               "loss": float(np.mean(losses)) if losses else float("nan"), "samples": samples}
        self._write_member_events(it)
        self.metrics.write(row)
        self._observe_round(greps, compute, t_g)
        self._check_health(it, losses, self.version > version, len(alive), gather_timeout)
        return row

    def _apply(self, grad: np.ndarray, it: int) -> list:
        """Optimizer step with the aggregated gradient on the elements someone delivered.

        Returns the element ranges nobody delivered (not applied: parameters and
        optimizer state untouched there). The divergence guard (``NormGuard``)
        clips the aggregate's norm first. A non-finite aggregate (possible only
        through overflow, since non-finite contributions are refused) is not
        applied at all.
        """
        agg = self.aggregator
        self._clip_scale = 1.0
        if agg.rejected:
            self.log(f"[ps{self.shard}] round {it}: refused {agg.rejected} gradient(s) with NaN/inf values")
        if not agg.contributors:
            return [(0, self.n)]
        if not np.isfinite(grad.sum(dtype=np.float32)):
            self.log(f"[ps{self.shard}] round {it}: the aggregated gradient is not finite; update skipped")
            return [(0, self.n)]
        mask = agg.applied_mask()
        self._clip_scale = self.guard.apply(grad, mask)
        self.optimizer.step(grad, mask=mask)
        self.version += 1
        return agg.uncovered() if mask is not None else []

    # -- health and deadlines ------------------------------------------------
    def _observe_round(self, greps, compute: list, t_g: float) -> None:
        """Feed the gather-deadline rule: compute times, RTprop/BtlBw estimates, complete-gather goodput."""
        if compute:
            self.deadline.observe_compute(max(compute))
        btlbw = 0.0
        for r in greps:
            raw = getattr(r, "raw", None)
            self.deadline.observe_rtprop(float(getattr(raw, "rtprop_s", 0.0) or 0.0))
            btlbw += float(getattr(raw, "btlbw_bps", 0.0) or 0.0)  # bytes/s, as on LTP's wire (docs/protocol.md)
        if btlbw > 0:
            self.deadline.observe_rate(btlbw)
        if greps and all(r.regime not in (TIMEOUT, CANCELLED) for r in greps):
            self.deadline.observe_transfer(sum(r.received_bytes for r in greps), t_g)

    def _check_health(self, it: int, losses: list, applied: bool, n_alive: int, timeout_s: float,
                      excused: bool = False) -> None:
        """Raise TrainingFailed on a non-finite loss/parameter or ``max_missed`` rounds in a row without an update.

        A round counts as empty when no update was applied: nobody delivered a
        usable gradient, or every contribution was refused, or the aggregate
        was not finite (skipped). Used by every BSP round, direct or program-driven.
        ``excused``: a tree is being repaired around a dead worker (it was dropped
        this round, or the trees without it start in a later round): an empty round
        then does not count (the repair takes a bounded number of rounds).
        """
        bad = [x for x in losses if not np.isfinite(x)]
        if bad:
            raise TrainingFailed(
                f"PS shard {self.shard}: round {it}: {len(bad)} of {len(losses)} workers reported a non-finite "
                f"loss ({bad[0]}); training diverged: lower --lr, or resume from an earlier --checkpoint-dir")
        if not np.isfinite(self.params).all():
            raise TrainingFailed(
                f"PS shard {self.shard}: round {it}: the parameters became non-finite after the optimizer step; "
                f"training diverged: lower --lr")
        self._last_applied = applied
        if n_alive == 0:
            return  # every worker was dropped during this round: _run_bsp waits for rejoins (or fails) next
        self._empty_rounds = 0 if applied else self._empty_rounds + (0 if excused else 1)
        if self._empty_rounds >= max(1, self.cfg.max_missed):
            raise TrainingFailed(
                f"PS shard {self.shard}: no usable gradient from any of {n_alive} live workers in "
                f"{self._empty_rounds} rounds in a row (no update applied: nothing delivered, every contribution "
                f"refused or the aggregate not finite; last gather bound {timeout_s:.2f} s); nothing is training. "
                f"Check the workers' logs; for large models on slow links raise --gather-timeout")

    def _write_member_events(self, iteration: int) -> None:
        """Joined / rejoined / dropped events since the last call, as metrics rows."""
        for ev in self.membership.drain_events():
            self.metrics.write({"event": ev.kind, "t": time.time(), "rank": ev.rank, "reason": ev.reason,
                                "iteration": iteration})
            if ev.kind == "dropped" and self.rendezvous is not None:
                try:
                    self.rendezvous.mark_dropped(ev.rank)
                except Exception as exc:  # the store is gone: the worker finds out at its --pull-timeout instead
                    self.log(f"[ps{self.shard}] could not post the drop of worker {ev.rank}: {exc}")

    def _raise_verdict(self) -> None:
        """Raise TrainingFailed when the run ends at chance accuracy (``ltp_ps.verdict``)."""
        why = self.verdict.failure()
        if why is not None:
            raise TrainingFailed(f"PS shard {self.shard}: {why}")

    def broadcast_timeout(self, n_peers: int) -> float:
        """Seconds a reliable parameter message to each of ``n_peers`` may take (derived per round)."""
        return self.deadline.broadcast_timeout(HEADER_BYTES + ELEM * self.n, n_peers)

    async def _wait_rejoin(self, where: str | None = None) -> None:
        """Every worker is gone: wait ``join_timeout_s`` for one to (re)join, else fail the job.

        ``where`` names the progress in the message (default: ``round i of n``).
        """
        where = where or f"round {self.iteration} of {self.total}"
        dropped = [f"worker {e.rank}: {e.reason}" for e in self.membership.events_log if e.kind == "dropped"]
        self.log(f"[ps{self.shard}] no live worker at {where}; waiting up to "
                 f"{self.cfg.join_timeout_s:.0f} s for workers to rejoin")
        t0 = time.monotonic()
        try:
            await self._wait_workers(1)
        except RendezvousError:
            raise TrainingFailed(
                f"PS shard {self.shard}: no live worker at {where} and none "
                f"rejoined within {time.monotonic() - t0:.1f} s ({'; '.join(dropped[-8:]) or 'all dropped'}); "
                f"the job stops without finishing") from None

    def _end_epoch(self, rows: list[dict], epoch: int | None = None) -> None:
        epoch = (self.iteration - 1) // self.ipe if epoch is None else epoch
        ev = self._evaluate(epoch)
        sync = [s for r in rows if (s := sync_s(r)) is not None] or [float("nan")]
        fr = [f for r in rows for f in r["delivered"].values()] or [float("nan")]
        row = {"event": "epoch", "t": time.time(), "shard": self.shard, "epoch": epoch,
               "iteration": self.iteration, "loss": epoch_loss(rows, self.workload.reports_loss),
               "sync_mean_s": float(np.mean(sync)),
               "delivered_mean": float(np.mean(fr)), "workers": len(self.membership.active()), **ev}
        self.metrics.write(row)
        self.verdict.observe(epoch, ev)
        acc = f"acc {ev['accuracy']:.4f}  " if "accuracy" in ev else ""
        line = (f"[ps{self.shard}] epoch {epoch + 1:>3}/{self.epochs_total}  {acc}loss {figure(row['loss'], '.4f')}  "
                f"sync {figure(row['sync_mean_s'] * 1e3, '7.2f'):>7} ms  delivered {row['delivered_mean']:.4f}  "
                f"workers {row['workers']}")
        self.epoch_lines.append(line)
        self.log(line)

    async def _stop_all(self, best_effort: bool = False) -> None:
        # A failing job also tells the dropped workers (they may be alive, just slow), so none waits for a PS
        # that is gone; the best-effort bound keeps dead ones from stalling the exit.
        members = list(self.membership.members.values()) if best_effort else self.membership.active()
        msg = self._params_message(KIND_STOP, {})
        timeout = self.deadline.broadcast_timeout(HEADER_BYTES, len(members))
        timeout = min(STOP_BEST_EFFORT_S, timeout) if best_effort else timeout
        try:
            if not hasattr(self.planner, "stop_program"):
                from .program_roles import server_stop

                return await server_stop(self, timeout)
            self._address(members)
            self._slots.bind("params", msg)
            prog = self.planner.stop_program(self.shard, self.iteration, [m.rank for m in members])
            prog = Program(self.node, tuple(tuple(dataclasses.replace(s, timeout_s=timeout) for s in st)
                                            for st in prog.stages))
            await self.executor.run(prog, self._slots, iteration=self.iteration)
        except Exception:
            if not best_effort:
                raise

    # -- executor bindings -------------------------------------------------
    def _address(self, members) -> None:
        for m in members:
            self.executor.addresses[worker_node(m.rank)] = tuple(m.addr)

    def _bind_round(self, it: int, members, msg) -> Program:
        """This shard's program for round ``it`` with its slots bound to the server's buffers."""
        self._address(members)
        self._slots.bind("params", msg)
        for m in members:
            self._slots.bind(f"ready:{worker_node(m.rank)}", self._ready_note)
            self._slots.bind(f"in:{worker_node(m.rank)}", self._bufs[m.rank])
        return self.planner.server_program(self.shard, it, [m.rank for m in members])

    async def _send_one(self, m, data, tag: int, payload: str) -> None:
        """One reliable message to one worker through the executor (async mode); raises what the send raised."""
        self._address([m])
        slot = f"out:{worker_node(m.rank)}"
        self._slots.bind(slot, data)
        res = await self.executor.run(Program(self.node, ((Send(worker_node(m.rank), slot, 0, 0, tag, RELIABLE,
                                                                payload),),)), self._slots)
        if isinstance(res.reports[0], BaseException):
            raise res.reports[0]

    # -- asynchronous ------------------------------------------------------
    async def _run_async(self) -> None:
        total_updates = self.total * self.cfg.world_size if self.cfg.iterations is None else self.total
        self._async_total = total_updates
        await self._wait_workers(self.cfg.min_workers or self.cfg.world_size)
        tasks: dict[int, asyncio.Task] = {}
        self._done = asyncio.Event()
        bar = _bar(total_updates, self.version, self.cfg.progress, f"ps{self.shard} async")
        self._async_bar = bar
        self._async_rows: list[dict] = []
        while not self._done.is_set():
            self._poll()
            self._write_member_events(self.version)
            for m in self.membership.active():
                t = tasks.get(m.rank)
                if t is None or t.done() or getattr(t, "generation", -1) != m.generation:
                    if t is not None and not t.done():
                        t.cancel()
                    t = asyncio.create_task(self._async_worker(m))
                    t.generation = m.generation
                    tasks[m.rank] = t
            if not self.membership.active() and not any(not t.done() for t in tasks.values()):
                await self._wait_rejoin(f"version {self.version} of {total_updates}")  # TrainingFailed if none
            try:
                await asyncio.wait_for(self._done.wait(), 0.05)
            except asyncio.TimeoutError:
                pass
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        self._write_member_events(self.version)
        if bar is not None:
            bar.close()
        if self._failed is not None:
            raise self._failed

    def _async_missed(self, rank: int, why: str) -> bool:
        """Count a miss of worker ``rank`` (asynchronous mode); True if it was dropped now, which is logged."""
        if not self.membership.missed(rank, why):
            return False
        self.log(f"[ps{self.shard}] dropped worker {rank}: {why} {self.cfg.max_missed} times in a row "
                 f"(version {self.version})")
        return True

    async def _async_worker(self, m) -> None:
        own = np.zeros(params_message_capacity(self.n), dtype=np.uint8)
        buf = self._bufs[m.rank]
        while m.state.value == "active" and m is self.membership.members.get(m.rank):
            if self._failed is not None:
                return
            if self.version >= self._async_total:
                why = self.verdict.failure()  # before STOP, so the workers read the failure too
                if why is not None:
                    self._failed = TrainingFailed(f"PS shard {self.shard}: {why}")
                    self._done.set()
                    return
                hdr = ParamsHeader(KIND_STOP, self.shard, self.version, self.version, 0, 0)
                hdr.pack_into(own)
                try:
                    await self._send_one(m, own[:HEADER_BYTES], tag_of(self.version, KIND_STOP), "stop")
                except Exception:
                    pass
                self._done.set()
                return
            v = self.version  # snapshot: other workers' updates land while we await
            ParamsHeader(KIND_PARAMS, self.shard, v, v, self.n, 0, v // (self.ipe * self.cfg.world_size)).pack_into(own)
            own[HEADER_BYTES:HEADER_BYTES + ELEM * self.n] = self._msg[HEADER_BYTES:HEADER_BYTES + ELEM * self.n]
            try:
                t0 = time.monotonic()
                await self._send_one(m, own[:HEADER_BYTES + ELEM * self.n], tag_of(v, KIND_PARAMS), "params")
                t_b = time.monotonic() - t0
                r = await self.schedule.server_recv_one(self.transport, m.addr, buf, iteration=v,
                                                        timeout=self.deadline.timeout(HEADER_BYTES + ELEM * self.n, 1))
            except Exception as exc:  # dead or slow worker
                if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
                    if self._async_missed(m.rank, "no gradient within the gather timeout"):
                        break
                    continue
                why = f"transfer failed at version {self.version}: {type(exc).__name__}: {exc}"
                self.membership.failed(m.rank, why)
                self.log(f"[ps{self.shard}] dropped worker {m.rank}: {why}")
                break
            c = self.schedule.contribution(m.rank, buf, r, self.n)
            if not c.usable or c.header.rank != m.rank:
                if self._async_missed(m.rank, "unusable gradient"):
                    break
                continue
            self.membership.delivered(m.rank)
            self.deadline.observe_compute(c.header.compute_s)
            if not np.isfinite(c.header.loss):
                self._failed = TrainingFailed(
                    f"PS shard {self.shard}: worker {m.rank} reported a non-finite loss ({c.header.loss}) at "
                    f"version {self.version}; training diverged: lower --lr")
                self._done.set()
                return
            if self.version >= self._async_total:
                continue  # the run's updates are all applied: a late gradient is not (STOP follows at the loop top)
            st = self.staleness.record(c.header.model_version, self.version)
            grad = self.schedule.combine(self.aggregator, [c])
            if not self.aggregator.contributors or not np.isfinite(grad.sum(dtype=np.float32)):
                if self._async_missed(m.rank, "non-finite gradient"):
                    break
                continue
            # no await between snapshot and update: atomic in asyncio
            mask = self.aggregator.applied_mask()
            self.guard.apply(grad, mask)
            self.optimizer.step(grad, mask=mask)
            self.version += 1
            self.iteration = self.version
            row = {"event": "iteration", "t": time.time(), "shard": self.shard, "iteration": self.version - 1,
                   "rank": m.rank, "staleness": st, "gather_s": r.duration_s, "broadcast_s": t_b,
                   "delivered": {str(m.rank): r.delivered_fraction}, "regime": {str(m.rank): r.regime},
                   "loss": c.header.loss, "samples": c.header.samples}
            self.metrics.write(row)
            self._async_rows.append(row)
            if self._async_bar is not None:
                self._async_bar.update(1)
            per_epoch = self.ipe * self.cfg.world_size
            if self.version % per_epoch == 0 or self.version == self._async_total:
                self._end_epoch(self._async_rows, (self.version - 1) // per_epoch)
                self._async_rows = []
            if self.cfg.checkpoint_every and self.version % self.cfg.checkpoint_every == 0:
                self.checkpoint()


STOP_BEST_EFFORT_S = 2.0  # seconds spent telling workers to stop when the job fails


def _miss_reason(r, timeout_s: float, waited_s: float) -> str:
    """Why a worker's gather slot came back empty, with the real elapsed time (the report's, else the wait's)."""
    elapsed = r.duration_s if r.duration_s > 0 else waited_s
    if r.regime == CANCELLED:
        return f"its gradient transfer failed after {elapsed:.2f} s (peer closed or unreachable)"
    return f"no gradient within {elapsed:.2f} s ({r.regime}; bound {timeout_s:.2f} s)"


def _bar(total, initial, enabled, desc):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="it", file=sys.stderr, leave=False)


def summary_text(server: ParameterServer, summary: dict) -> str:
    from .dynamic_roles import runs_async_controller

    # MLfabric's controller applies updates as they come, whatever --mode says
    mode = f"{server.planner.name} async" if runs_async_controller(server.planner) else server.cfg.mode
    return format_summary(summary, f"ltp-ps shard {server.shard} ({server.transport.name}, {mode}, "
                                   f"{server.cfg.aggregation})")
