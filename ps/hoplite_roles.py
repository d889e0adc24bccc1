"""PS and worker roles for ``--schedule hoplite``: BSP rounds driven by :class:`HopliteController`, or
``--mode async`` half-batch updates driven by :class:`~ltp_ps.schedules.hoplite_async.AsyncHalfBatchController`.

Theory of operation
-------------------
The PS (one shard, ``server:0``) holds Hoplite's object directory: it hosts the
schedule's controller in a :class:`~ltp_ps.schedules.driver.ControllerDriver`
and is the only node that decides anything.  Per worker it keeps the ordered
reliable control streams of ``ControlChannel`` (down: round notes, grants,
stop; up: events, a grant's receive reports batched into one message).

Round ``i``::

    PS -> every live worker   {"round": i, "version": v}
    PS                        controller.start(i, live workers): every worker asks for the parameters
    broadcast                 grants: the PS (complete copy) or a worker holding a partial copy sends
                              chunks (256 KiB) into the receiver's chunk slots, which are bound to the
                              worker's flat parameter vector; each receive is reported as
                              ChunkArrived then TransferDone, so the directory knows who holds what
    compute                   a worker holding every chunk computes its gradient ("grad") and reports
                              NodeReady(i); the controller chains it into the reduce
    reduce                    grants: Combine(acc <- grad), then the tail sends acc to the newest ready
                              worker (or, last, to the PS), which combines it
    apply                     the PS's Combine + Apply: one optimizer step with the mean of the
                              partial's contributors (unbiased per element), version += 1

A worker's grants run in the order issued, one stage each, with one
exception (cut-through): in BSP rounds a grant of forwards only (the worker
serves its partial parameter copy) runs in a second lane beside the receive
lane, and each chunk leaves the moment this round's copy of it is held
(``Slots.on_report``), so a broadcast chain is pipelined per 256 KiB chunk
instead of store-and-forward per hop; a relay whose chunk never arrives gives
up after the step's timeout, and its receiver is re-routed by the directory (a fetch of the same shard from
another source supersedes the one running: the receiver drops it at once).
Chunks are reported to the directory every ``PROGRESS_REPORT_S`` as they
arrive.  Reduce hops stay store-and-forward: a node sends its running sum on
once its incoming hop is combined.  Faults: workers send an
``{"alive": true}`` note every ``HEARTBEAT_S``; a worker whose control stream
closes, whose grant delivery fails, or that stays silent for ``SILENT_S``
(``--join-timeout`` if shorter) is reported ``NodeFailed``; one silent for ``PROBE_AFTER_S`` is sent a probe
on a stream of its own (``PROBE``, read and ignored), and a probe that finds no process there (``PeerGone``:
a killed worker's port answers ICMP unreachable) writes it off at once, where nothing else would have been sent
to it until the silence ran out (a paused worker answers nothing either way: the silence decides).  Every
other worker is told
``{"failed": node}`` (a stage with that peer is aborted at once: the
re-routed grants queue behind it); the controller re-routes the
broadcast and the chain (``ltp_ps.schedules.hoplite``) and the round closes
with the contributions of the live workers (``contributors`` in the metrics
row).  A worker the PS takes back (``{"back": node}``) may be a restarted process on a new port: its peers
look its address up again.  A round with no progress (:func:`is_progress`: a failed transfer is none) for
``--join-timeout``, or that loses every
worker fails the job with :class:`TrainingFailed` (never a hang).

Asynchronous mode (``_AsyncServerRole``): one controller and one driver for
the whole run; the PS first tells every worker ``{"async": true}``, then only
grants flow down.  A worker computes on every parameter version it completes
(the version is the broadcast tags' iteration field) and reports
``NodeReady(version=v)``; the PS applies update ``u`` in order, snapshots the
parameters as version ``u + 1`` (the broadcast reads the snapshot) and feeds
``UpdateApplied(u)``.  Its own grants run in three lanes (sends, receives,
combine/apply) so a broadcast never delays the next update's receive.  Every
``RETURN_POLL_S`` it takes in workers that joined again (written off while
paused, cut off, or restarted): fresh control streams, the mode note, the
others told it is back, then the controller's ``admit`` (it gets the next
version with that update's members).
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import numpy as np

from .errors import ConfigError, RemoteError, TrainingFailed, TransportTimeout
from .schedules.driver import (DOWN, PROBE, UP, ControlChannel, ControlDecodeError, ControllerDriver, event_from_json,
                               event_to_json, next_control_message, stop_workers, transfer_events)
from .schedules.executor import IN_ORDER_WINDOW, Slots
from .schedules.hoplite import chunk_slot, parse_chunk_slot
from .schedules.hoplite_async import UpdateApplied, batch_of_slot, half_batch, params_key
from .schedules.partial import Partial
from .schedules.tags import unpack as unpack_tag
from .schedules.program import (SLOT_GRAD, ChunkArrived, Grant, NodeFailed, NodeReady, Program, TransferDone,
                                parse_node, server as server_node, worker as worker_node)
from .transport.base import RecvReport

BATCH_BYTES = 32 * 1024  # JSON bytes of grants batched into one control message (CONTROL_BYTES is 64 KiB)
EVENTS_PER_MESSAGE = 200  # a grant's receive reports per control message (~130 bytes each; CONTROL_BYTES is 64 KiB)
POLL_S = 0.01  # seconds between the PS's looks at a round's progress
HEARTBEAT_S = 0.5  # seconds between a worker's "alive" notes (a worker blocked on a dead peer is not silent)
SILENT_S = 10.0  # seconds without a note (20 heartbeats) before the PS writes a worker off: a worker paused or cut off
#                  while no transfer with it was in flight is found by nothing else (no send to it fails)
PROBE_AFTER_S = 4 * HEARTBEAT_S  # seconds without a note before the PS probes the worker: a send to a process that
#                                  is gone fails at once (ICMP port unreachable, a refused connection: PeerGone),
#                                  so a killed worker is written off then, not after SILENT_S
QUIESCE_S = 2.0  # seconds the PS waits, after a round closed, for grants still being delivered
RETURN_POLL_S = 0.5  # --mode async: seconds between the PS's looks at the store for workers joining again
READY_STAGGER_ENV = "LTP_HOPLITE_READY_STAGGER_S"  # experiments only: rank r reports its gradient r x this many
#                                                    seconds after computing it (the lab's staggered-arrival row)
IN_ORDER_PAYLOADS = frozenset({"params"})  # a parameter chunk grant's sends complete in chunk order (cut-through)
PROGRESS_REPORT_S = 0.5  # seconds between a worker's reports of the parameter chunks it received (BSP)
PROCESS_STALL_TIMEOUT_S = 5.0  # seconds without a chunk before a broadcast receiver re-queries (real processes:
#                               a grant's chunks arrive as one stage, so progress is coarser than in memory)


def is_progress(ev) -> bool:
    """Whether a worker's event moves a round (or update) on: anything but a failed transfer.  Transfers failing
    over and over (a livelock: say, sends to an address nobody listens on any more) must meet the stall bound
    (``--join-timeout``) and fail the job, not hold it forever."""
    return not (isinstance(ev, TransferDone) and not ev.ok)


def runs_hoplite(planner) -> bool:
    """True for the planner the roles here drive."""
    return getattr(planner, "name", None) == "hoplite"


def chunk_ranges(lo: int, hi: int, chunk_bytes: int, elem_bytes: int = 4) -> list:
    """Element ranges of the broadcast chunks of shard ``[lo, hi)`` (the controller's layout)."""
    per = max(1, chunk_bytes // elem_bytes)
    n = max(1, -(-(hi - lo) // per))
    return [(lo + i * per, min(hi, lo + (i + 1) * per)) for i in range(n)]


class _PieceDriver(ControllerDriver):
    """The BSP PS runs each reduce piece's final receive in its own lane (keyed by the piece's first
    element), so pieces arrive side by side; Combines and Apply stay in issue order in the node's lane."""

    def queue_key(self, grant: Grant):
        if grant.node == self.me and grant.steps and all(s.op == "recv" and s.payload == "partial"
                                                         for s in grant.steps):
            return (grant.node, "recv", grant.steps[0].lo)
        return grant.node


class _Handlers:
    def __init__(self, role: "_ServerRole"):
        self.role = role

    def apply(self, step, slots: Slots):
        return self.role.apply(step, slots)


class _ServerRole:
    def __init__(self, ps):
        if ps.plan.n_shards != 1:
            raise ConfigError(f"--schedule hoplite runs with one PS shard (the directory and reduce receiver); "
                              f"the job has {ps.plan.n_shards}: pass --num-servers 1")
        self.ps = ps
        ps.executor.in_order_payloads = IN_ORDER_PAYLOADS
        self.ctrl = self._controller()
        self.ctrl.stall_timeout_s = max(self.ctrl.stall_timeout_s, PROCESS_STALL_TIMEOUT_S)
        self.channels: dict = {}
        self.failed: set = set()
        self.driver: ControllerDriver | None = None
        self.counters = {"undecodable": 0, "silent": 0, "closed": 0, "rounds": 0}
        self.applied: dict | None = None
        self.error: TrainingFailed | None = None
        self._t_bcast: float | None = None
        self._t_ready: float | None = None
        self._live: list = []
        self._notes: set = set()
        self._progress = 0.0  # monotonic seconds of the last event or failure (a round's stall bound counts from it)
        self._bind_params()

    def _controller(self):
        return self.ps.planner.controller()

    def _bind_params(self) -> None:
        """BSP: the PS sends every round's chunks straight from its parameters."""
        ps = self.ps
        for k, (a, b) in enumerate(chunk_ranges(ps.lo, ps.hi, self.ctrl.chunk_bytes, self.ctrl.elem_bytes)):
            ps._slots.bind(chunk_slot(ps.shard, k), ps.params[a - ps.lo:b - ps.lo].view(np.uint8))

    # -- apply ----------------------------------------------------------------------------------------------------
    def apply(self, step, slots: Slots):
        p = slots.assembled(step.slot, step.lo, step.hi)  # a reduce in pieces: one partial per piece's chain
        slots.clear_partials()  # the round's sum and the hops' inputs are used once
        self.applied = self._step(p, f"round {self.ps.iteration}")
        return None

    def _step(self, p, what: str) -> dict:
        """One optimizer step with the mean of partial ``p`` (None or empty: no step); the applied summary."""
        ps = self.ps
        if p is None or p.contributors == 0:
            return {"contributors": 0, "t": time.monotonic()}
        c = p.contributors
        loss = p.loss_sum / c
        if not np.isfinite(loss):
            self.error = TrainingFailed(f"PS shard {ps.shard}: {what}: the reduce of {c} gradients "
                                        f"reported a non-finite loss ({loss}); training diverged: lower --lr")
            return {"contributors": c, "t": time.monotonic()}
        grad = p.mean(ps.cfg.aggregation)
        counts = p.counts()
        mask = None if (counts > 0).all() else counts > 0
        ps._clip_scale = 1.0
        if np.isfinite(grad.sum(dtype=np.float32)):
            ps._clip_scale = ps.guard.apply(grad, mask)
            ps.optimizer.step(grad, mask=mask)
            ps.version += 1
        else:
            ps.log(f"[ps{ps.shard}] {what}: the aggregated gradient is not finite; update skipped")
        return {"contributors": c, "loss": float(loss), "samples": p.samples,
                "delivered": float((counts > 0).mean()) if counts.size else 0.0,
                "short_pieces": self._short_pieces(counts), "t": time.monotonic()}

    def _short_pieces(self, counts) -> int:
        """BSP rounds: reduce pieces that lost an input on every element (:meth:`HopliteController.short_pieces`)."""
        return self.ctrl.short_pieces(counts, self.ps.shard, self.ps.lo)

    # -- messages -------------------------------------------------------------------------------------------------
    async def deliver(self, node: str, grant: Grant) -> None:
        await self.channels[node].send({"grant": grant.to_json()}, timeout_s=self.ps.broadcast_timeout(1))

    async def deliver_batch(self, node: str, grants: list) -> None:
        """Grants queued for ``node`` together go in as few control messages as fit ``BATCH_BYTES`` each (the
        channel sends one message at a time, each waiting for its acknowledgement)."""
        batch, size = [], 0
        for g in grants:
            j = g.to_json()
            n = len(json.dumps(j, separators=(",", ":")))
            if batch and size + n > BATCH_BYTES:
                await self._send_grants(node, batch)
                batch, size = [], 0
            batch.append(j)
            size += n
        await self._send_grants(node, batch)

    async def _send_grants(self, node: str, batch: list) -> None:
        msg = {"grant": batch[0]} if len(batch) == 1 else {"grants": batch}
        await self.channels[node].send(msg, timeout_s=self.ps.broadcast_timeout(1))

    async def listen(self, node: str) -> None:
        """Turn ``node``'s up-stream messages into controller events until it fails or the run ends."""
        ch = self.channels[node]
        rank = parse_node(node)[1]
        heard = [time.monotonic()]
        prober = asyncio.ensure_future(self._probe_when_silent(node, rank, ch.epoch, heard))
        try:
            while True:
                msg = await next_control_message(ch, min(SILENT_S, self.ps.cfg.join_timeout_s), self.counters,
                                                 lambda why: self._fail(node, rank, why))
                if msg is None:
                    return
                heard[0] = time.monotonic()
                if "alive" in msg:
                    continue
                self._dispatch(node, rank, msg)
        finally:
            prober.cancel()

    async def _probe_when_silent(self, node: str, rank: int, epoch: int, heard: list) -> None:
        """While ``node`` is live here: once it has been silent for ``PROBE_AFTER_S``, send it a probe; a probe
        that finds no process (``ConnectionError``: ``PeerGone``) writes it off.  Any other outcome (answered:
        alive; no answer within ``SILENT_S``: paused or cut off) leaves the verdict to the silence rule."""
        probes = ControlChannel(self.ps.executor, node, out_dir=PROBE, in_dir=PROBE, epoch=epoch,
                                patience_s=SILENT_S)
        probed = float("-inf")  # when the last probe went (one per PROBE_AFTER_S at most, answered or not)
        while node not in self.failed:
            now = time.monotonic()
            quiet = now - heard[0]
            wait = PROBE_AFTER_S - min(quiet, now - probed)
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            probed = now
            self.counters["probes"] = self.counters.get("probes", 0) + 1
            try:
                await probes.send({"probe": round(quiet, 3)}, timeout_s=PROBE_AFTER_S)
            except ConnectionError as exc:
                self.counters["gone"] = self.counters.get("gone", 0) + 1
                self._fail(node, rank, f"gone: a probe after {quiet:.1f} s of silence found no process there ({exc})")
                return
            except Exception:
                pass  # not answered (paused, cut off): the silence rule decides

    def _dispatch(self, node: str, rank: int, msg: dict) -> None:
        """One up-stream message (not a heartbeat): its events, in order."""
        batch = msg.get("events") if "events" in msg else [msg]
        if not isinstance(batch, list):
            self.counters["undecodable"] += 1
            return
        for d in batch:  # a grant's reports come as one message, in order (chunks before transfer ends)
            self._event(node, rank, d)

    def _event(self, node: str, rank: int, d) -> None:
        try:
            ev = event_from_json(d, node) if isinstance(d, dict) else None
        except ControlDecodeError:
            ev = None
        if ev is None:
            self.counters["undecodable"] += 1
            return
        if self.driver is None:
            return
        if isinstance(ev, NodeReady):
            if not self._accepts(ev):
                return
            self.ps.membership.delivered(rank)
        self.driver.feed(ev)
        self._observe(ev)

    def _accepts(self, ev: NodeReady) -> bool:
        return ev.iteration == self.ps.iteration

    def _observe(self, ev) -> None:
        """Progress bookkeeping after an event (BSP: when every worker held the parameters / was ready).  A failed
        transfer is no progress: transfers failing over and over (a livelock) must meet the round's stall bound."""
        now = time.monotonic()
        if is_progress(ev):
            self._progress = now
        if isinstance(ev, NodeReady) and self._t_ready is None and set(self.ctrl.reduce.ready_nodes) >= {
                n for n in self._live if n not in self.failed}:
            self._t_ready = now
        if isinstance(ev, ChunkArrived) and self._t_bcast is None and all(
                b.complete(n) for b in self.ctrl.broadcasts for n in self._live if n not in self.failed):
            self._t_bcast = now

    def _fail(self, node: str, rank: int, why: str) -> None:
        if node in self.failed:
            return
        self.failed.add(node)
        self.ps.membership.failed(rank, why)
        self.ps.log(f"[ps{self.ps.shard}] dropped worker {rank}: {why}")
        for n, ch in self.channels.items():  # abort their transfers with it (grants behind them would wait)
            if n not in self.failed:
                t = asyncio.ensure_future(self._note_failed(ch, node))
                self._notes.add(t)
                t.add_done_callback(self._notes.discard)
        if self.driver is not None:
            self.driver.feed(NodeFailed(node, why))
        self._progress = time.monotonic()

    async def _note_failed(self, ch: ControlChannel, node: str) -> None:
        try:
            await ch.send({"failed": node}, timeout_s=self.ps.broadcast_timeout(1))
        except Exception:
            pass  # that worker's own failure is detected by its listener

    # -- rounds ---------------------------------------------------------------------------------------------------
    async def _note_round(self, node: str, it: int) -> None:
        try:
            await self.channels[node].send({"round": it, "version": self.ps.version},
                                           timeout_s=self.ps.broadcast_timeout(1))
        except Exception as exc:
            self._fail(node, parse_node(node)[1], f"round note failed: {type(exc).__name__}: {exc}")

    async def round(self, it: int, nodes: list) -> dict:
        ps = self.ps
        t0 = time.monotonic()
        self.applied, self._t_bcast, self._t_ready = None, None, None
        await asyncio.gather(*(self._note_round(n, it) for n in nodes))
        live = [n for n in nodes if n not in self.failed]
        self._live = live
        if not live:
            raise TrainingFailed(self._all_lost(it))
        driver = _PieceDriver(self.ctrl, ps.executor, ps._slots, _Handlers(self), deliver=self.deliver,
                              deliver_batch=self.deliver_batch, iteration=it)
        self.driver = driver
        driver.start(live)
        try:
            while self.applied is None:
                if driver.errors:
                    raise TrainingFailed(f"PS shard {ps.shard}: round {it}: the PS's own grant failed: "
                                         f"{type(driver.errors[0]).__name__}: {driver.errors[0]}")
                if not [n for n in live if n not in self.failed]:
                    raise TrainingFailed(self._all_lost(it))
                if self.ctrl.done() and not self.ctrl.contributions():
                    raise TrainingFailed(f"PS shard {ps.shard}: round {it} closed with no contribution (every "
                                         f"chained worker was lost); the job stops without finishing")
                if time.monotonic() - max(t0, self._progress) > ps.cfg.join_timeout_s:
                    raise TrainingFailed(
                        f"PS shard {ps.shard}: hoplite round {it} made no progress for {ps.cfg.join_timeout_s:.0f} s "
                        f"(--join-timeout; ready: {sorted(self.ctrl.reduce.ready_nodes)}, failed: "
                        f"{sorted(self.failed)}); nothing is training")
                await asyncio.sleep(POLL_S)
            t_end = self.applied.get("t", time.monotonic())
            deadline = time.monotonic() + QUIESCE_S  # let queued deliveries finish: a cancelled send breaks a stream
            while time.monotonic() < deadline and (
                    driver.busy() or any(ch._lock.locked() for ch in self.channels.values())):
                await asyncio.sleep(POLL_S)
        finally:
            await driver.close()
            self.driver = None
        if self.error is not None:
            raise self.error
        a = self.applied
        contributors = sorted(self.ctrl.contributions())
        ps.iteration += 1
        self.counters["rounds"] += 1
        t_b = (self._t_bcast or t_end) - t0
        t_g = max(0.0, t_end - (self._t_ready or t_end))
        row = {"event": "iteration", "t": time.time(), "shard": ps.shard, "iteration": it, "epoch": it // ps.ipe,
               "workers": len([n for n in live if n not in self.failed]), "contributors": a["contributors"],
               "members": contributors, "gather_s": t_g, "broadcast_s": t_b, "round_s": t_end - t0,
               "delivered": {"all": a.get("delivered", 0.0)}, "regime": {}, "clip_scale": ps._clip_scale,
               "loss": a.get("loss", float("nan")), "samples": a.get("samples", 0), "schedule": "hoplite",
               "grants": driver.counters["grants"], "short_pieces": a.get("short_pieces", 0)}
        ps._write_member_events(it)
        ps.metrics.write(row)
        ps._check_health(it, [row["loss"]] if a["contributors"] else [], a["contributors"] > 0, len(live), 0.0)
        return row

    def _all_lost(self, it: int) -> str:
        dropped = [f"{e.rank}: {e.reason}" for e in self.ps.membership.events_log if e.kind == "dropped"]
        return (f"PS shard {self.ps.shard}: every worker was lost at round {it} of {self.ps.total} "
                f"({'; '.join(dropped[-8:])}); the job stops without finishing")

    async def admit_returns(self, nodes: list, listeners: dict) -> list:
        """Between rounds: take in workers whose join the store verified since the last look -- one this PS dropped
        (paused, cut off) and that joined again, a restarted process, or a late first join.  Each gets fresh
        control streams (the join's ticket is their epoch, so nothing of the old streams is ever read as new),
        and every other worker is told it is back before any grant can name it.  Returns the nodes taken in."""
        ps = self.ps
        back = []
        for n, m, again in ps.returning_workers(self.channels):
            self.failed.discard(n)
            if n not in nodes:
                nodes.append(n)
            ps.reopen_control(n, m, self.channels, listeners, self.listen)
            back.append(n)
            self.counters["readmitted"] = self.counters.get("readmitted", 0) + again
            ps.log(f"[ps{ps.shard}] worker {m.rank} {'joined again' if again else 'joined'} "
                   f"(generation {m.generation}); it takes part from round {ps.iteration}")
        if back:
            await asyncio.gather(*self._notes, return_exceptions=True)  # earlier "failed" notes go first
            await asyncio.gather(*(self._note_back(n, b) for n in nodes if n not in self.failed and n not in back
                                   for b in back))
        return back

    async def _note_back(self, node: str, back: str) -> None:
        try:
            await self.channels[node].send({"back": back}, timeout_s=self.ps.broadcast_timeout(1))
        except Exception as exc:
            self._fail(node, parse_node(node)[1], f"note failed: {type(exc).__name__}: {exc}")

    async def run(self) -> None:
        ps = self.ps
        await ps._wait_workers(ps.cfg.min_workers or ps.cfg.world_size)
        members = ps.membership.active()
        ps._address(members)
        nodes = [worker_node(m.rank) for m in members]
        for n, m in zip(nodes, members):
            self.channels[n] = ControlChannel(ps.executor, n, out_dir=DOWN, in_dir=UP,
                                              epoch=ps.join_tickets.get(m.rank, 0))
        ps.log(f"[ps{ps.shard}] hoplite: receiver-driven broadcast and reduce chains through the PS's directory, "
               f"{len(nodes)} workers, {ps.total} rounds")
        listeners = {n: asyncio.ensure_future(self.listen(n)) for n in nodes}
        try:
            rows: list = []
            while ps.iteration < ps.total:
                await self.admit_returns(nodes, listeners)
                rows.append(await self.round(ps.iteration, [n for n in nodes if n not in self.failed]))
                if ps.iteration % ps.ipe == 0 or ps.iteration == ps.total:
                    ps._end_epoch(rows)
                    rows = []
                if ps.cfg.checkpoint_every and ps.iteration % ps.cfg.checkpoint_every == 0:
                    ps.checkpoint()
            ps._raise_verdict()  # a model at chance accuracy fails the job, before STOP
        except TrainingFailed as exc:
            if ps.rendezvous is not None:  # before STOP, so no worker reads "done" and exits 0
                ps.rendezvous.mark_failed(str(exc))
            raise
        finally:
            for t in [*listeners.values(), *self._notes]:
                t.cancel()
            await asyncio.gather(*listeners.values(), *self._notes, return_exceptions=True)
            ps.hoplite_stats = {**self.counters, "failed_workers": sorted(self.failed)}
            await self.stop_all()

    async def stop_all(self) -> None:
        await stop_workers(self.channels, self.failed)


class _LaneDriver(ControllerDriver):
    """The asynchronous PS runs its own grants in three independent in-order lanes -- parameter sends
    (broadcasts), gradient receives (final hops) and combine/apply -- so it receives update ``u + 1``
    while it still broadcasts version ``u + 1`` and never holds an apply behind a receive."""

    def queue_key(self, grant: Grant):
        if grant.node != self.me:
            return grant.node
        ops = {s.op for s in grant.steps}
        lane = "apply" if ops & {"apply", "combine"} else "send" if ops <= {"send", "forward"} else "recv"
        return (grant.node, lane)

    async def _run_local(self, g: Grant) -> None:
        try:
            await super()._run_local(g)
        finally:
            self.handlers.local_grant_done(g)  # its parameter snapshots may go now (queued grants keep them)


class _AsyncServerRole(_ServerRole):
    """``--mode async``: half-batch updates through :class:`AsyncHalfBatchController` (one driver, whole run).

    Update ``u`` reduces the first ``ceil(n/2)`` gradients that become ready; its Apply (in update order)
    steps the optimizer with their mean, snapshots the parameters as version ``u + 1`` (the broadcast
    sends from the snapshot, so later updates never tear it) and feeds ``UpdateApplied``."""

    def __init__(self, ps):
        self.snapshots: dict = {}  # version -> parameter copy still being broadcast
        self.rows: list = []
        self.n_workers = 0
        self.updates = 0
        self.per_epoch = 1
        self._recv_slots: dict = {}  # update -> the PS's partial slots of its final hops
        self._snapshot_users: dict = {}  # version -> the PS's own grants queued or running that send from it
        self._t_last = None
        super().__init__(ps)

    def _controller(self):
        return self.ps.planner.async_controller()

    def _short_pieces(self, counts) -> int:
        return 0  # asynchronous updates (AsyncHalfBatchController) have no BSP pieces; their rows do not report it

    def _bind_params(self) -> None:
        self._snapshot(0)

    def _snapshot(self, v: int) -> None:
        ps = self.ps
        snap = self.snapshots[v] = ps.params.copy()
        for k, (a, b) in enumerate(chunk_ranges(ps.lo, ps.hi, self.ctrl.chunk_bytes, self.ctrl.elem_bytes)):
            ps._slots.bind(chunk_slot(ps.shard, k) + f"@{v}", snap[a - ps.lo:b - ps.lo].view(np.uint8))
        keep = self.ctrl.live_versions() | {v} | set(self._snapshot_users)
        for old in [x for x in self.snapshots if x not in keep]:
            del self.snapshots[old]
            for k in range(len(chunk_ranges(ps.lo, ps.hi, self.ctrl.chunk_bytes, self.ctrl.elem_bytes))):
                ps._slots.buffers.pop(chunk_slot(ps.shard, k) + f"@{old}", None)

    def _accepts(self, ev: NodeReady) -> bool:
        return True  # the controller checks the version it expects from that worker

    def _observe(self, ev) -> None:
        if is_progress(ev):
            self._progress = time.monotonic()

    @staticmethod
    def _sent_versions(g: Grant) -> set:
        """The parameter versions a PS grant sends from (its snapshots' slots, ``...@v``)."""
        return {v for st in g.steps if st.op in ("send", "forward") and st.payload == "params"
                and (v := batch_of_slot(st.slot)) is not None}

    def local_grant_done(self, g: Grant) -> None:
        for v in self._sent_versions(g):
            n = self._snapshot_users.get(v, 0) - 1
            if n > 0:
                self._snapshot_users[v] = n
            else:
                self._snapshot_users.pop(v, None)

    def _on_grants(self, grants) -> None:
        for g in grants:
            if g.node == self.driver_me:
                for v in self._sent_versions(g):
                    # a send queued behind others may run after its version's broadcast is done (a receiver
                    # re-routed to the PS when a relay died): its snapshot stays until it ran
                    self._snapshot_users[v] = self._snapshot_users.get(v, 0) + 1
                for st in g.steps:
                    if st.op == "recv" and st.payload == "partial":
                        u = batch_of_slot(st.slot)
                        if u is not None:
                            self._recv_slots.setdefault(u, set()).add(st.slot)

    def apply(self, step, slots: Slots):
        ps = self.ps
        u = batch_of_slot(step.slot)
        p = slots.partial(step.slot, step.lo, step.hi)
        for name in self._recv_slots.pop(u, set()) | {step.slot}:  # this update's sum and hop inputs: used once
            slots.partials(name).clear()
        staleness = dict(self.ctrl.staleness.get(u, {}))
        members = sorted(self.ctrl.contributions(u))
        a = self._step(p, f"update {u}")
        for w in members:
            ps.staleness.record(u - staleness.get(w, 0), u)
        self._snapshot(u + 1)
        ps.iteration = u + 1
        now = time.monotonic()
        row = {"event": "iteration", "t": time.time(), "shard": ps.shard, "iteration": u,
               "epoch": u // self.per_epoch, "workers": len(self.ctrl.live), "contributors": a["contributors"],
               "members": members, "staleness": {w: staleness.get(w, 0) for w in members},
               "gather_s": None, "broadcast_s": None,  # no sync round (as MLfabric's): updates apply as gradients come
               "round_s": now - (self._t_last or self._t0),
               "delivered": {"all": a.get("delivered", 0.0)}, "regime": {}, "clip_scale": ps._clip_scale,
               "loss": a.get("loss", float("nan")), "samples": a.get("samples", 0), "schedule": "hoplite",
               "mode": "async", "version": ps.version}
        self._t_last = now
        self.rows.append(row)
        ps._write_member_events(u)
        ps.metrics.write(row)
        if self.error is None:
            try:
                ps._check_health(u, [row["loss"]] if a["contributors"] else [], a["contributors"] > 0,
                                 len(self.ctrl.live), 0.0)
            except TrainingFailed as exc:
                self.error = exc
        if self.error is None and ((u + 1) % self.per_epoch == 0 or u + 1 == self.updates):
            ps._end_epoch(self.rows, u // self.per_epoch)
            self.rows = []
        self.driver.feed(UpdateApplied(u, 0))
        return None

    async def run(self) -> None:
        ps = self.ps
        await ps._wait_workers(ps.cfg.min_workers or ps.cfg.world_size)
        members = ps.membership.active()
        ps._address(members)
        nodes = [worker_node(m.rank) for m in members]
        self.n_workers = ws = len(nodes)
        m = self.ctrl.quota_override or half_batch(ws)
        # --iterations counts updates; --epochs the gradients a direct async PS applies (ws per round), so the
        # run sees as many samples as direct async: ceil(total * ws / m) updates of m gradients each
        self.updates = ps.total if ps.cfg.iterations is not None else -(-ps.total * ws // m)
        self.per_epoch = max(1, -(-ps.ipe * ws // m))
        self.ctrl.updates = self.updates
        ps.epochs_total = -(-self.updates // self.per_epoch)
        for n, mem in zip(nodes, members):
            self.channels[n] = ControlChannel(ps.executor, n, out_dir=DOWN, in_dir=UP,
                                              epoch=ps.join_tickets.get(mem.rank, 0))
        ps.log(f"[ps{ps.shard}] hoplite async: half-batch updates of {m} of {ws} workers' gradients through "
               f"receiver-driven chains, {self.updates} updates, staleness <= {self.ctrl.max_staleness}")
        await asyncio.gather(*(self._note_async(n) for n in nodes))
        listeners = {n: asyncio.ensure_future(self.listen(n)) for n in nodes}
        self.driver_me = ps.executor.me
        driver = _LaneDriver(self.ctrl, ps.executor, ps._slots, self, deliver=self.deliver,
                             on_grants=self._on_grants)
        self._t0 = self._progress = time.monotonic()
        next_poll = self._t0 + RETURN_POLL_S
        try:
            live = [n for n in nodes if n not in self.failed]
            if not live:
                raise TrainingFailed(self._all_lost(0))
            self.driver = driver
            driver.start(live)
            while not self.ctrl.done():
                if time.monotonic() >= next_poll:
                    await self.admit_async_returns(listeners)
                    next_poll = time.monotonic() + RETURN_POLL_S
                if self.error is not None:
                    raise self.error
                if driver.errors:
                    raise TrainingFailed(f"PS shard {ps.shard}: hoplite async update {self.ctrl.applied}: the PS's "
                                         f"own grant failed: {type(driver.errors[0]).__name__}: {driver.errors[0]}")
                if not self.ctrl.live:
                    raise TrainingFailed(self._all_lost(self.ctrl.applied))
                if time.monotonic() - self._progress > ps.cfg.join_timeout_s:
                    raise TrainingFailed(
                        f"PS shard {ps.shard}: hoplite async update {self.ctrl.applied} made no progress for "
                        f"{ps.cfg.join_timeout_s:.0f} s (--join-timeout; live: {sorted(self.ctrl.live)}); "
                        f"nothing is training")
                await asyncio.sleep(POLL_S)
            if self.error is not None:
                raise self.error
            deadline = time.monotonic() + QUIESCE_S  # grants already queued reach their worker (no torn stream)
            while time.monotonic() < deadline and (driver.busy() or any(ch._lock.locked()
                                                                        for ch in self.channels.values())):
                await asyncio.sleep(POLL_S)
            if self.rows:
                ps._end_epoch(self.rows, (self.updates - 1) // self.per_epoch)
                self.rows = []
            ps._raise_verdict()
        except TrainingFailed as exc:
            if ps.rendezvous is not None:
                ps.rendezvous.mark_failed(str(exc))
            raise
        finally:
            await driver.close()
            self.driver = None
            for t in [*listeners.values(), *self._notes]:
                t.cancel()
            await asyncio.gather(*listeners.values(), *self._notes, return_exceptions=True)
            ps.hoplite_stats = {**self.counters, **self.ctrl.counters, "updates": self.ctrl.applied,
                                "failed_workers": sorted(self.failed)}
            await self.stop_all()

    async def admit_async_returns(self, listeners: dict) -> list:
        """Take in workers whose join the store verified since the last look (written off and joined again, a
        restarted process): fresh control streams (epoch: the join's ticket), the mode note, every other worker
        told it is back, then the controller takes it back (``admit``; it gets the next version broadcast)."""
        ps = self.ps
        back = []
        for n, m, again in ps.returning_workers(self.channels):
            if n not in self.failed:
                # a new incarnation before this PS wrote the old one off: what the controller holds for the old
                # one (its place in open chains, a broadcast to it) is written off like a failure's
                self.driver.feed(NodeFailed(n, "it joined again (a new incarnation)"))
            self.failed.discard(n)
            ps.reopen_control(n, m, self.channels, listeners, self.listen)
            await self._note_async(n)  # the mode first: its grants follow on the same ordered stream
            if n in self.failed:
                continue  # the note failed: written off again
            await asyncio.gather(*self._notes, return_exceptions=True)  # earlier "failed" notes go first
            await asyncio.gather(*(self._note_back(x, n) for x in list(self.channels)
                                   if x != n and x not in self.failed))
            self.driver.revive(n)
            self._progress = time.monotonic()
            self.counters["readmitted"] = self.counters.get("readmitted", 0) + again
            ps.log(f"[ps{ps.shard}] worker {m.rank} {'joined again' if again else 'joined'} "
                   f"(generation {m.generation}); it gets version {self.ctrl.applied + 1} or later")
            back.append(n)
        if back:
            ps._write_member_events(ps.iteration)
        return back

    async def _note_async(self, node: str) -> None:
        try:
            await self.channels[node].send({"async": True}, timeout_s=self.ps.broadcast_timeout(1))
        except Exception as exc:
            self._fail(node, parse_node(node)[1], f"mode note failed: {type(exc).__name__}: {exc}")


async def server_run(ps) -> None:
    """Training at PS shard ``ps`` through Hoplite's controller: BSP rounds, or ``--mode async`` half-batch
    updates (raises TrainingFailed)."""
    if ps.cfg.mode == "async":
        await _AsyncServerRole(ps).run()
    else:
        await _ServerRole(ps).run()


# -- worker ---------------------------------------------------------------------------------------------------------

async def worker_run(w) -> dict:
    """Train worker ``w`` under the PS's Hoplite controller until STOP; returns its stats."""
    from .workloads import set_flat

    if w._batches is None:
        w._batches = w.workload.batches(w.cfg.rank, w.cfg.world_size, w.cfg.seed)
    if len(w.shards) != 1:
        raise RemoteError(f"worker {w.cfg.rank}: hoplite serves one PS shard, the job has {len(w.shards)}")
    s0 = w.shards[0]
    ps = server_node(s0.shard)
    ch = ControlChannel(w.executor, ps, out_dir=UP, in_dir=DOWN, patience_s=w.cfg.pull_timeout_s,
                        epoch=w.join_tickets.get(s0.shard, 0))
    probes = ControlChannel(w.executor, ps, out_dir=PROBE, in_dir=PROBE, epoch=ch.epoch)
    w.executor.in_order_payloads = IN_ORDER_PAYLOADS
    ctrl = w.planner.controller()
    chunks = chunk_ranges(s0.lo, s0.hi, ctrl.chunk_bytes, ctrl.elem_bytes)
    for k, (a, b) in enumerate(chunks):
        w.slots.bind(chunk_slot(s0.shard, k), w.flat[a:b].view(np.uint8))
    stats = {"grants": 0, "rounds": 0, "undecodable": 0}
    # async: the PS's first note says so; then versions (the broadcast tags' iteration field) replace rounds
    state = {"round": None, "version": 0, "have": set(), "computing": None, "async": False, "have_v": {}}
    try:
        stagger_s = max(0.0, float(os.environ.get(READY_STAGGER_ENV, "0") or 0))
    except ValueError:
        raise ConfigError(f"{READY_STAGGER_ENV} must be seconds (a float), not "
                          f"{os.environ.get(READY_STAGGER_ENV)!r}") from None

    async def compute(it: int, version: int) -> None:
        if w.cfg.max_iterations is not None and w.iterations >= w.cfg.max_iterations:
            state["drill_exit"] = True  # --max-iterations (launch --kill-worker-after): leave once the last one is in
            reader.cancel()
            return
        if w.model is not None:
            set_flat(w.model, w.flat)
        batch = await asyncio.to_thread(next, w._batches)  # off the loop: a batch can take seconds
        grad, loss, samples = await asyncio.to_thread(w.workload.compute, w.model, batch)
        if stagger_s > 0:
            await asyncio.sleep(stagger_s * w.cfg.rank)
        if not state["async"] and state["round"] != it:
            return  # the round closed without us (we were written off): drop it
        grad = np.asarray(grad, np.float32)
        w.slots.put_partial(SLOT_GRAD, Partial.of_gradient(grad, samples=samples, loss=loss))
        w.last_loss = loss
        w.iterations += 1
        post([NodeReady(w.node, it, 0, version, float(np.linalg.norm(grad)))])

    inbox: asyncio.Queue = asyncio.Queue()
    current: dict = {"grant": None, "task": None}
    relay: dict = {"grant": None, "task": None}  # the forward lane's grant now running (cut-through)
    relays: asyncio.Queue = asyncio.Queue()  # BSP forward-only grants, run beside the receive lane
    held: dict = {}  # chunk index -> asyncio.Event, set the moment this round's copy of the chunk is held
    pending: list = []  # ChunkArrived events not yet reported to the directory

    def chunk_event(k: int) -> asyncio.Event:
        ev = held.get(k)
        if ev is None:
            ev = held[k] = asyncio.Event()
        return ev

    def on_report(slot: str, r) -> None:
        """A receive into a slot ended (BSP): a parameter chunk is held from now on -- it may be relayed at
        once, and the directory hears of it with the next report (cut-through; chunks are reported as they
        arrive, so a long transfer never looks stalled)."""
        if state["async"]:
            return
        kc = parse_chunk_slot(slot)
        if kc is None or kc[0] != s0.shard or not (isinstance(r, RecvReport) and r.complete):
            return  # a chunk cut short is not held: it is fetched again, never relayed or computed on
        if not 0 <= kc[1] < len(chunks):
            return
        state["have"].add(kc[1])
        a, b = chunks[kc[1]]
        pending.append(ChunkArrived(w.node, f"params:{kc[0]}", a, b, len(state["have"]) == len(chunks)))
        chunk_event(kc[1]).set()

    w.slots.on_report = on_report

    async def relay_one(step, window: asyncio.Semaphore) -> None:
        async with window:  # in chunk order, IN_ORDER_WINDOW at a time (as the PS sends them)
            kc = parse_chunk_slot(step.slot)
            if kc is not None and kc[0] == s0.shard and 0 <= kc[1] < len(chunks):
                try:
                    await asyncio.wait_for(chunk_event(kc[1]).wait(), w.executor._timeout(step))
                except (asyncio.TimeoutError, TimeoutError):
                    stats["relay_timeouts"] = stats.get("relay_timeouts", 0) + 1
                    return  # never held: its receiver's transfer fails and the directory re-routes it
            await w.executor.run(Program(w.node, ((step,),)), w.slots, None, exclude=dead_peers)

    async def relay_lane() -> None:
        """Forward-only grants (this worker serves its partial copy to one receiver): each chunk leaves as
        soon as it is held, while the receive lane is still fetching the rest."""
        while True:
            g = await relays.get()
            window = asyncio.Semaphore(IN_ORDER_WINDOW)
            t = asyncio.ensure_future(asyncio.gather(*(relay_one(st, window) for st in g.steps),
                                                     return_exceptions=True))
            relay.update(grant=g, task=t)
            try:
                errors = [e for e in await t if isinstance(e, BaseException)]
                if errors:  # a relay that cannot run fails this worker, as a receive-lane grant would
                    raise errors[0]
            except asyncio.CancelledError:
                # only the lane's own cancellation ends the lane.  ``t.cancelled()`` cannot tell: a cancelled
                # gather ends with a CancelledError *exception* (not cancelled), and treating that as ours ended
                # the lane for good when a round note or a peer's death aborted a relay -- every later forward
                # grant then waited in the queue, and its receiver's whole round for the 60 s receive timeout
                if asyncio.current_task().cancelling():
                    raise
                stats["aborted"] = stats.get("aborted", 0) + 1
            finally:
                relay.update(grant=None, task=None)

    def new_round() -> None:
        held.clear()  # the old round's events stay set for nobody: its relays are cancelled below
        pending.clear()
        while not relays.empty():
            relays.get_nowait()
        if relay["task"] is not None:
            relay["task"].cancel()
        for t in list(hops_in):  # the old round's hops (it closed without them)
            t.cancel()
        for f in hop_done.values():  # continuations still waiting on them are dropped
            if not f.done():
                f.set_result(False)
        hop_done.clear()
        combined.clear()
        sent_tags.clear()

    async def report_progress() -> None:
        while True:
            await asyncio.sleep(PROGRESS_REPORT_S)
            if pending:
                post(pending[:])
                pending.clear()

    outbox: list = []  # events for the PS, in order; one sender drains them, batching what queued meanwhile
    outbox_ready = asyncio.Event()

    def post(events) -> None:
        outbox.extend(events)
        outbox_ready.set()

    async def send_events() -> None:
        """The up-stream's one event sender: whatever queued while the last message was in flight goes in the
        next (a message waits for its acknowledgement, so one send per event would queue round trips)."""
        while True:
            await outbox_ready.wait()
            outbox_ready.clear()
            while outbox:
                batch = outbox[:EVENTS_PER_MESSAGE]
                del outbox[:len(batch)]
                await ch.send({"events": [event_to_json(ev) for ev in batch]})

    async def read() -> dict:
        """Control messages in order; "failed" aborts a running transfer with the dead node at once."""
        while True:
            try:
                msg = await ch.recv(w.cfg.pull_timeout_s)
            except ControlDecodeError:
                stats["undecodable"] += 1
                continue
            if msg is None:
                raise TransportTimeout(f"worker {w.cfg.rank}: no control message from the PS within "
                                       f"{w.cfg.pull_timeout_s:g} s (--pull-timeout); the PS may have dropped this "
                                       f"worker or exited")
            if "stop" in msg:
                return {"iterations": w.iterations, "last_loss": w.last_loss, "stopped": True, **stats}
            if "back" in msg:  # the PS took that worker in again (it joined anew): its transfers run again
                dead_peers.discard(msg["back"])
                w.executor.refresh_address(msg["back"])  # a restarted process listens elsewhere
                continue
            if "failed" in msg:
                # a grant with that peer that has not started yet must not wait for it either: until the PS
                # says it is back (a new join), its transfers report missing at once
                dead_peers.add(msg["failed"])
                for t, g in list(hops_in.items()):
                    if any(getattr(s, "peer", None) == msg["failed"] for s in g.steps):
                        aborted[t] = True
                        t.cancel()
                for lane in (current, relay):
                    g, t = lane["grant"], lane["task"]
                    if g is not None and t is not None and any(getattr(s, "peer", None) == msg["failed"]
                                                               for s in g.steps):
                        t.cancel()
                        if lane is current:
                            stats["aborted"] = stats.get("aborted", 0) + 1
                continue
            inbox.put_nowait(msg)

    async def heartbeat() -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            await ch.send({"alive": True})

    async def read_probes() -> None:
        """The PS's liveness probes (``PROBE`` stream): taken and dropped; answering them is the transport's."""
        while True:
            try:
                if await probes.recv(w.cfg.pull_timeout_s) is not None:
                    stats["probes"] = stats.get("probes", 0) + 1
            except ControlDecodeError:
                stats["undecodable"] += 1
            except ConnectionError:
                return  # the PS closed its streams: the control reader sees it too

    work: asyncio.Queue = asyncio.Queue()
    dead_peers: set = set()  # nodes the PS wrote off ("failed" notes)
    hops_in: dict = {}  # task -> grant: reduce-hop receives running beside the work lane (BSP)

    async def receive_hop(g: Grant, done: asyncio.Future) -> None:
        """A reduce hop's receive (BSP): runs beside the work lane, so this node combines and sends piece j on
        while piece j + 1 still arrives; the PS grants the Combine after the TransferDone sent here, or a
        continuation of this receive (``Grant.after``) already waits in the work lane for ``done``."""
        reports = [None] * len(g.steps)
        try:
            reports = (await w.executor.run(Program(w.node, (tuple(g.steps),)), w.slots, None,
                                            exclude=dead_peers)).reports
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me.cancelling() > 1 or not aborted.pop(me, False):
                raise
            me.uncancel()  # aborted: the sender died; every receive counts as failed
        finally:
            events = transfer_events(w.node, g.steps, reports)
            if not done.done():
                done.set_result(bool(events) and all(ev.ok for ev in events))
        post(events)

    hop_done: dict = {}  # BSP: hop receive slot -> future of its outcome (True: every range ended well)
    combined: set = set()  # hop receive slots combined into the running sum (each at most once)
    sent_tags: set = set()  # tags of the continuations' sends made (a continuation granted again is not re-run)

    async def continuation(g: Grant):
        """A hop granted as a continuation of this node's receive into ``g.after``: once that receive ended
        well, combine it (once) and send the running sum on -- no round trip through the PS.  None: dropped (the
        receive failed, or the hop already left in an earlier grant of it); else the program to run."""
        fut = hop_done.get(g.after)
        ok = fut is not None and await asyncio.shield(fut)
        tags = {s.tag for s in g.steps if s.op in ("send", "forward")}
        if not ok or (tags and tags <= sent_tags):
            stats["continuations_dropped"] = stats.get("continuations_dropped", 0) + 1
            return None
        local = tuple(s for s in g.steps if s.op not in ("send", "forward", "recv")
                      and not (s.op == "combine" and s.src in combined))
        transfers = tuple(s for s in g.steps if s.op in ("send", "forward", "recv"))
        combined.add(g.after)
        sent_tags.update(tags)
        stats["continuations"] = stats.get("continuations", 0) + 1
        return Program(w.node, tuple(st for st in (local, transfers) if st))

    aborted: dict = {}  # hop receive tasks cancelled because their sender died (they still report)

    async def dispatch() -> None:
        """Control messages in order: a BSP forward-only grant goes to the relay lane at once (even while the
        receive lane still runs the grant that fills the chunks it relays), everything else to the work lane."""
        while True:
            msg = await inbox.get()
            if "async" in msg:
                state["async"] = True
                continue
            if "round" in msg:
                new_round()
                work.put_nowait(msg)
                continue
            many = msg.get("grants")
            for gj in (many if isinstance(many, list) else [msg.get("grant")]):
                route(gj)

    def route(gj) -> None:
        """One grant of the PS's, in order: to the relay lane, a hop receive of its own, or the work lane."""
        try:
            g = Grant.from_json(gj)
        except (KeyError, TypeError, ValueError, AttributeError):
            stats["undecodable"] += 1
            return
        stats["grants"] += 1
        if not g.steps or g.drop:
            return
        if not state["async"] and all(st.op == "forward" for st in g.steps):
            relays.put_nowait(g)
        elif not state["async"] and all(st.op == "recv" and st.payload == "partial" for st in g.steps):
            done = hop_done[g.steps[0].slot] = asyncio.get_running_loop().create_future()
            t = asyncio.ensure_future(receive_hop(g, done))
            hops_in[t] = g
            t.add_done_callback(lambda t: hops_in.pop(t, None))
            t.add_done_callback(_raise_later)
        else:
            if not state["async"]:
                supersede(g)
            work.put_nowait(g)

    def fetch_object(g: Grant):
        """The shard whose parameter chunks grant ``g`` fetches, with its source; None if it is no such fetch."""
        kcs = [parse_chunk_slot(st.slot) if st.op == "recv" and st.payload == "params" else None for st in g.steps]
        if not kcs or any(kc is None for kc in kcs) or len({kc[0] for kc in kcs}) != 1 or len(
                {st.peer for st in g.steps}) != 1:
            return None
        return kcs[0][0], g.steps[0].peer

    def supersede(g: Grant) -> None:
        """A fetch of an object from another source than the fetch of it now running (BSP): the directory keeps one
        fetch per receiver and object, so it gave up on the running one (its sender stalled, and was suspected):
        stop waiting for it now -- else the new fetch queues behind it until its receive timeout.  What arrived
        of it was reported chunk by chunk; the new fetch names only the chunks still missing."""
        new, cur, t = fetch_object(g), current["grant"], current["task"]
        if new is None or cur is None or t is None or t.done():
            return
        old = fetch_object(cur)
        if old is not None and old[0] == new[0] and old[1] != new[1]:
            t.cancel()
            stats["superseded"] = stats.get("superseded", 0) + 1

    async def follow() -> None:
        while True:
            g = await work.get()
            if isinstance(g, dict):  # a round note, in order with the grants around it
                state.update(round=int(g["round"]), version=int(g.get("version", 0)), have=set())
                w.slots.clear_partials()
                stats["rounds"] += 1
                continue
            steps = tuple(g.steps)
            if sent_tags and g.after is None:  # a hop a continuation already sent (granted again after a failure)
                steps = tuple(s for s in steps if not (s.op == "send" and s.payload == "partial" and s.tag in sent_tags))
                if not steps:
                    continue
            prog = Program(w.node, (steps,))
            if g.after is not None:
                prog = await continuation(g)
                if prog is None:
                    continue
            t = asyncio.ensure_future(w.executor.run(prog, w.slots, None, exclude=dead_peers))
            current.update(grant=g, task=t)
            try:
                reports = (await t).reports
            except asyncio.CancelledError:
                # we are cancelled ourselves (STOP arrived while this grant ran: awaiting ``t`` cancelled it too,
                # so ``t.cancelled()`` alone cannot tell; swallowing it left this task waiting forever)
                if not t.cancelled() or asyncio.current_task().cancelling():
                    raise
                reports = [None] * len(prog.steps())  # aborted: a peer died; every receive counts as failed
            finally:
                current.update(grant=None, task=None)
            events = []
            fresh = None
            for s, r in zip(prog.steps(), reports):
                if (state["async"] and s.op == "recv" and s.payload == "params" and isinstance(r, RecvReport)
                        and r.complete):
                    kc = parse_chunk_slot(s.slot)
                    if kc is None:
                        continue
                    v = unpack_tag(s.tag).iteration  # the version is the broadcast tag's iteration field
                    have = state["have_v"].setdefault(v, set())
                    have.add(kc[1])
                    events.append(ChunkArrived(w.node, params_key(kc[0], v), s.lo, s.hi, len(have) == len(chunks)))
                    if len(have) == len(chunks):
                        fresh = v
            if not state["async"]:  # BSP: the chunks held and not yet reported (on_report), then the transfer ends
                events, pending[:] = pending[:], []
            events += transfer_events(w.node, prog.steps(), reports)
            post(events)  # chunks first: the directory learns what we hold before the transfer ends
            if fresh is not None and state["computing"] != fresh:
                # version ``fresh`` is complete: our last update was applied, so its partials are spent
                state["have_v"] = {v: h for v, h in state["have_v"].items() if v > fresh}
                state["computing"] = fresh
                w.slots.clear_partials()
                t = asyncio.ensure_future(compute(fresh, fresh))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                t.add_done_callback(_raise_later)
            elif not state["async"] and len(state["have"]) == len(chunks) and state["computing"] != state["round"]:
                state["computing"] = state["round"]
                t = asyncio.ensure_future(compute(state["round"], state["version"]))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                t.add_done_callback(_raise_later)

    tasks: set = set()
    failure: list = []

    def _raise_later(t: asyncio.Task) -> None:
        if not t.cancelled() and t.exception() is not None:
            failure.append(t.exception())
            reader.cancel()

    reader = asyncio.ensure_future(read())
    fol = asyncio.ensure_future(follow())
    beat = asyncio.ensure_future(heartbeat())
    probed = asyncio.ensure_future(read_probes())
    lane = asyncio.ensure_future(relay_lane())
    prog = asyncio.ensure_future(report_progress())
    disp = asyncio.ensure_future(dispatch())
    sender = asyncio.ensure_future(send_events())
    for t in (fol, beat, probed, lane, prog, disp, sender):
        t.add_done_callback(_raise_later)
    try:
        return await reader
    except asyncio.CancelledError:
        if failure:
            raise failure[0] from None
        if state.get("drill_exit") and asyncio.current_task().cancelling() == 0:
            return {"iterations": w.iterations, "last_loss": w.last_loss, "stopped": False, **stats}
        raise
    finally:
        w.slots.on_report = None
        for t in [fol, beat, probed, lane, prog, disp, sender, *tasks, *hops_in,
                  *([relay["task"]] if relay["task"] is not None else [])]:
            t.cancel()
        await asyncio.gather(fol, beat, probed, lane, prog, disp, sender, *tasks, return_exceptions=True)
