"""PS and worker roles for asynchronous controller-driven schedules (``--schedule mlfabric``).

Theory of operation
-------------------
The PS hosts the schedule's controller (:class:`~ltp_ps.schedules.driver.ControllerDriver`)
and is the only node that decides anything.  Per worker it keeps two ordered
reliable streams: control (grants, stop; ``ControlChannel``) and parameters
(``params_tag(j)``: the ``j``-th parameter message this worker gets).

Worker ``w``::

    recv params j        reliable (ParamsHeader | params), version v
    compute              gradient at those parameters -> partial in slot "grad"
    announce             NodeReady(w, j, version=v, norm=||g||) on the up stream
    wait                 until a grant consumed "grad" (sent to its hop, combined
                         at the aggregator, or dropped)
    j += 1

Meanwhile its :class:`~ltp_ps.schedules.driver.GrantFollower` runs every grant
in order (its own update's send; an aggregator's receives, combines and
forward) and reports each receive to the PS as ``TransferDone``.

PS: a listener per worker turns up-stream messages into controller events;
a grant to a worker is delivered at its ``start_at`` (PS clock).  A worker
gets its next parameters when its update's fate is final (the paper's async
SGD: push, then pull the latest model): right after the ``Apply`` of the
commit that carried it (whether or not its bytes arrived), or right after a
grant that dropped it.  Sending them at grant time instead (the first
version of this module) made every next gradient miss the worker's own
previous update and lost a third of the updates to the delay bound
(docs/schedules.md, "Parameters after apply").  The PS's own grants
(receive, then ``Apply``, per commit in order) run on its executor.  A worker
whose stream closes, whose grant delivery fails, or that stays silent for
``--store-timeout`` is reported ``NodeFailed``; the controller writes off what
it held.  After ``epochs x iterations-per-epoch x workers`` gradients are
applied the PS sends every live worker STOP.

Apply of an aggregate of ``c`` gradients (async SGD semantics): one optimizer
step with ``c`` times the partial's unbiased mean (the sum of the ``c``
gradients where all delivered; lost elements are scaled up from the ones that
arrived), and the version advances by ``c`` -- exactly what ``c`` separate
plain-SGD steps would do with the same gradients.  The divergence guard clips
the *mean* before scaling (an aggregate is not a diverging gradient).
Staleness of each member = PS version just before the step minus the version
it was computed on; steps beyond ``tau_max`` are counted (``beyond_tau``;
MLfabric guarantees none).
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from .errors import RemoteError, TrainingFailed, TransportTimeout
from .schedules.driver import (DOWN, T_LAG_S, UP, ControlChannel, ControlDecodeError, ControllerDriver, GrantFollower,
                               event_from_json, grant_uses_gradient, next_control_message, params_tag, stop_workers)
from .schedules.executor import Slots
from .schedules.partial import Partial
from .schedules.program import (RELIABLE, SLOT_GRAD, NodeFailed, NodeReady, Program, Recv, Send, parse_node,
                                server as server_node, worker as worker_node)
from .transport.base import RecvReport
from .wire import ELEM, HEADER_BYTES, KIND_PARAMS, ParamsHeader, params_message_capacity

ASYNC_CONTROLLER_SCHEDULES = ("mlfabric",)  # schedules whose controller serves asynchronous updates
POLL_S = 0.05  # seconds between the PS's looks at its progress
JOIN_POLL_S = 0.5  # seconds between the PS's looks at the store for workers that joined (again)


def runs_async_controller(planner) -> bool:
    """True for planners the roles here drive (an asynchronous PS controller)."""
    return getattr(planner, "name", None) in ASYNC_CONTROLLER_SCHEDULES


class _ServerHandlers:
    """The PS's ``Apply``: one step with ``c x`` the unbiased mean of an aggregate of ``c`` gradients."""

    def __init__(self, role: "_ServerRole"):
        self.role = role

    def apply(self, step, slots: Slots):
        return self.role.apply(step, slots)


class _ServerRole:
    def __init__(self, ps):
        self.ps = ps
        self.ctrl = ps.planner.controller()
        self.ctrl.v_next = ps.version
        self.tau_max = self.ctrl.tau_max
        self.total = ps.total * ps.cfg.world_size if ps.cfg.iterations is None else ps.total
        self.per_epoch = ps.ipe * ps.cfg.world_size
        self.channels: dict = {}
        self.params_seq: dict = {}
        self.versions: dict = {}  # slot -> (members, versions) of a planned commit
        self.rows: list = []
        self.beyond_tau = 0
        self.applied_steps = 0
        self.last_apply = time.monotonic()
        self._planned = 0
        self.failed: TrainingFailed | None = None
        self.counters = {"undecodable": 0, "silent": 0, "closed": 0, "after_end": 0}
        self.driver: ControllerDriver | None = None
        self._param_sends: set = set()  # parameter sends started by an Apply
        self._closing = False  # the run ended: a parameter send cut short now is no worker failure

    # -- plans ----------------------------------------------------------------------------------------------------
    def on_grants(self, grants) -> None:
        """Index the commits of every batch planned since the last call (slot -> members and their versions)."""
        batches = self.ctrl.stats["batches"]
        while self._planned < batches:
            b = self._planned
            plan = self.ctrl.plans[-(batches - b)] if batches - b <= len(self.ctrl.plans) else None
            self._planned += 1
            if plan is None:
                continue
            for c in plan.commits:
                slot = f"mlf:{b}:{c.group}:{c.members[0].position}"
                self.versions[slot] = ([m.update.node for m in c.members], [m.update.version for m in c.members])

    # -- apply ----------------------------------------------------------------------------------------------------
    def apply(self, step, slots: Slots):
        members = self.versions.get(step.slot, ([], []))[0]
        try:
            return self._apply(step, slots)
        finally:
            for m in members:  # their update's fate is final: they pull the latest model (paper §3, async SGD)
                self._send_params_soon(m)

    def _send_params_soon(self, node: str) -> None:
        if self.driver is None or node in self.driver.failed or node not in self.channels:
            return
        if self.ps.version >= self.total:
            return  # STOP follows
        t = asyncio.ensure_future(self.send_params(node))
        self._param_sends.add(t)
        t.add_done_callback(lambda t, node=node: self._param_sent(t, node))

    def _param_sent(self, t: asyncio.Task, node: str) -> None:
        self._param_sends.discard(t)
        if t.cancelled():
            return
        exc = t.exception()
        if exc is not None and not self._closing:  # a worker marked failed would get no STOP
            self._fail(node, parse_node(node)[1], f"parameters failed: {type(exc).__name__}: {exc}")

    def _apply(self, step, slots: Slots):
        ps = self.ps
        p = slots.partial(step.slot, step.lo, step.hi)
        members, versions = self.versions.pop(step.slot, ([], []))
        slots._partials.pop(step.slot, None)  # a commit's slot is used once
        if p is None or p.contributors == 0:
            return None
        if ps.version >= self.total:
            # the run has every gradient it trains on; commits still in flight when the last one was applied
            # (a burst after a stall of this PS) are not trained on, nor counted as another epoch
            self.counters["after_end"] += 1
            return None
        c = p.contributors
        loss = p.loss_sum / c
        if not np.isfinite(loss):
            self.failed = TrainingFailed(
                f"PS shard {ps.shard}: an update of {c} gradient(s) from {members} reported a non-finite loss "
                f"({loss}) at version {ps.version}; training diverged: lower --lr")
            return None
        grad = p.mean(ps.cfg.aggregation)
        if not np.isfinite(grad.sum(dtype=np.float32)):
            ps.log(f"[ps{ps.shard}] version {ps.version}: the aggregated gradient is not finite; update skipped")
            return None
        counts = p.counts()
        mask = None if (counts > 0).all() else counts > 0
        ps._clip_scale = ps.guard.apply(grad, mask)  # on the mean: an aggregate is not a diverging gradient
        if c > 1:
            grad *= np.float32(c)
        before = ps.version
        st = [ps.staleness.record(v, before) for v in versions] or [0]
        self.beyond_tau += sum(1 for s in st if self.tau_max is not None and s > self.tau_max)
        ps.optimizer.step(grad, mask=mask)
        ps.version += c
        ps.iteration = ps.version
        self.applied_steps += 1
        self.last_apply = time.monotonic()
        row = {"event": "iteration", "t": time.time(), "shard": ps.shard, "iteration": before, "version": ps.version,
               "source": members[0] if len(members) == 1 else "aggregate", "members": members, "contributors": c,
               "staleness": max(st), "staleness_all": st, "gather_s": None, "broadcast_s": None,  # no sync round
               "delivered": {"all": float((counts > 0).mean()) if counts.size else 0.0}, "regime": {},
               "loss": loss, "samples": p.samples, "schedule": ps.planner.name}
        ps.metrics.write(row)
        self.rows.append(row)
        if before // self.per_epoch != ps.version // self.per_epoch or ps.version >= self.total:
            ps._end_epoch(self.rows, min(before // self.per_epoch, (self.total - 1) // self.per_epoch))
            self.rows = []
        if ps.cfg.checkpoint_every and before // ps.cfg.checkpoint_every != ps.version // ps.cfg.checkpoint_every:
            ps.checkpoint()
        return None

    # -- messages -------------------------------------------------------------------------------------------------
    async def send_params(self, node: str) -> None:
        ps = self.ps
        j = self.params_seq.get(node, 0)
        self.params_seq[node] = j + 1
        v = ps.version
        msg = np.zeros(params_message_capacity(ps.n), dtype=np.uint8)
        ParamsHeader(KIND_PARAMS, ps.shard, v, v, ps.n, 0, v // self.per_epoch).pack_into(msg)
        msg[HEADER_BYTES:HEADER_BYTES + ELEM * ps.n] = ps._msg[HEADER_BYTES:HEADER_BYTES + ELEM * ps.n]
        slots = Slots()
        slots.bind("params", msg[:HEADER_BYTES + ELEM * ps.n])
        slots.bind_critical("params", ())
        res = await ps.executor.run(Program(ps.node, ((Send(node, "params", 0, 0, params_tag(j, self.channels[node].epoch),
                                                            RELIABLE, "params",
                                                            timeout_s=ps.broadcast_timeout(1)),),)), slots)
        r = res.reports[0]
        if isinstance(r, BaseException):
            raise r
        self.driver.monitor.observe(r, src=ps.node, dst=node)

    async def deliver(self, node: str, grant) -> None:
        try:
            await self.channels[node].send({"grant": grant.to_json()}, timeout_s=self.ps.broadcast_timeout(1))
            if grant_uses_gradient(grant) and grant.drop and self.ps.version < self.total:
                await self.send_params(node)  # dropped: compute again at once (applied ones: after their Apply)
        except Exception as exc:
            # written off here, not only by the driver: the membership and the store's drop count say so, so the
            # worker (paused, cut off) rejoins as soon as it runs instead of waiting out its --pull-timeout
            if not self._closing:
                self._fail(node, parse_node(node)[1], f"grant delivery failed: {type(exc).__name__}: {exc}")
            raise

    async def listen(self, node: str) -> None:
        """Turn ``node``'s up-stream messages into controller events until it fails or the run ends."""
        ch = self.channels[node]
        rank = parse_node(node)[1]
        while True:
            msg = await next_control_message(ch, self.ps.cfg.join_timeout_s, self.counters,
                                             lambda why: self._fail(node, rank, why))
            if msg is None:
                return
            try:
                ev = event_from_json(msg, node)
            except ControlDecodeError:
                self.counters["undecodable"] += 1
                continue
            if isinstance(ev, NodeReady):
                self.ps.membership.delivered(rank)
            self.driver.feed(ev)

    def _fail(self, node: str, rank: int, why: str) -> None:
        if node in self.driver.failed:
            return
        self.ps.membership.failed(rank, why)
        self.ps.log(f"[ps{self.ps.shard}] dropped worker {rank}: {why}")
        self.ps._write_member_events(self.ps.version)  # the metrics row, and the store's drop count the worker watches
        self.driver.feed(NodeFailed(node, why))

    # -- run ------------------------------------------------------------------------------------------------------
    async def run(self) -> None:
        ps = self.ps
        await ps._wait_workers(ps.cfg.min_workers or ps.cfg.world_size)
        self.last_apply = time.monotonic()  # the stall bound counts from the start, not from construction
        members = ps.membership.active()
        ps._address(members)
        nodes = [worker_node(m.rank) for m in members]
        for n, m in zip(nodes, members):
            self.channels[n] = ControlChannel(ps.executor, n, out_dir=DOWN, in_dir=UP,
                                              epoch=ps.join_tickets.get(m.rank, 0))
        t_lag = getattr(ps.planner, "t_lag_s", None) or T_LAG_S
        self.driver = ControllerDriver(self.ctrl, ps.executor, ps._slots, _ServerHandlers(self), deliver=self.deliver,
                                       on_grants=self.on_grants, t_lag_s=t_lag)
        ps.log(f"[ps{ps.shard}] {ps.planner.name}: asynchronous updates through the controller "
               f"(tau_max {self.tau_max}, {self.ctrl.k} aggregator(s) per batch, batch window "
               f"{self.ctrl.batch_window_s:g} s, t_lag {t_lag:g} s), {self.total} gradients")
        self.driver.start(nodes)
        listeners = {n: asyncio.ensure_future(self.listen(n)) for n in nodes}
        first = await asyncio.gather(*(self.send_params(n) for n in nodes), return_exceptions=True)
        for n, r in zip(nodes, first):
            if isinstance(r, BaseException):
                self._fail(n, parse_node(n)[1], f"first parameters failed: {type(r).__name__}: {r}")
        next_poll = time.monotonic() + JOIN_POLL_S
        try:
            while ps.version < self.total and self.failed is None:
                if time.monotonic() >= next_poll:
                    next_poll = time.monotonic() + JOIN_POLL_S
                    self.admit_returns(nodes, listeners)
                live = [n for n in nodes if n not in self.driver.failed]
                if not live:
                    raise TrainingFailed(f"PS shard {ps.shard}: every worker was lost at version {ps.version} of "
                                         f"{self.total} ({'; '.join(f'{e.rank}: {e.reason}' for e in ps.membership.events_log if e.kind == 'dropped')[-400:]}); "
                                         f"the job stops without finishing")
                if self.driver.errors:
                    raise self.driver.errors[0]
                if time.monotonic() - self.last_apply > ps.cfg.join_timeout_s:
                    raise TrainingFailed(f"PS shard {ps.shard}: no update applied for {ps.cfg.join_timeout_s:.0f} s "
                                         f"at version {ps.version} ({len(live)} live workers); nothing is training")
                await asyncio.sleep(POLL_S)
            if self.failed is None:
                ps._raise_verdict()  # a model at chance accuracy fails the job, before STOP (ltp_ps.verdict)
            if self.failed is not None:
                raise self.failed
        except TrainingFailed as exc:
            if ps.rendezvous is not None:  # before STOP, so no worker reads "done" and exits 0
                ps.rendezvous.mark_failed(str(exc))
            raise
        finally:
            self._closing = True
            for t in list(self._param_sends):
                t.cancel()
            await self.driver.close()
            for t in [*listeners.values(), *self._param_sends]:
                t.cancel()
            await asyncio.gather(*listeners.values(), *self._param_sends, return_exceptions=True)
            ps.mlfabric_stats = self.stats()
            await self.stop_all()

    def admit_returns(self, nodes: list, listeners: dict) -> list:
        """Take in workers whose join the store verified since the last look: one the PS wrote off that joined
        again, a restarted process, a late first join.  Fresh control and parameter streams (the join's ticket is
        their epoch), the controller plans its updates again, and it gets the current parameters at once."""
        ps = self.ps
        back = []
        for n, m, again in ps.returning_workers(self.channels):
            if again and n not in self.driver.failed:
                # it joined again before this PS wrote it off (it gave up on us first): what the controller holds
                # for the old incarnation (a pending update, hops through it) is written off like a failure's
                self.driver.feed(NodeFailed(n, "it joined again (a new incarnation)"))
            self.params_seq[n] = 0
            if n not in nodes:
                nodes.append(n)
            self.driver.revive(n)
            ps.reopen_control(n, m, self.channels, listeners, self.listen)
            self.counters["readmitted"] = self.counters.get("readmitted", 0) + again
            ps.log(f"[ps{ps.shard}] worker {m.rank} {'joined again' if again else 'joined'} "
                   f"(generation {m.generation}); it gets the parameters of version {ps.version}")
            self._send_params_soon(n)
            back.append(n)
        if back:
            ps._write_member_events(ps.version)
        return back

    async def stop_all(self) -> None:
        await stop_workers(self.channels, self.driver.failed)

    def stats(self) -> dict:
        c = self.ctrl
        return {"beyond_tau": self.beyond_tau, "tau_max": self.tau_max, "apply_steps": self.applied_steps,
                "planned": c.stats["planned"], "dropped": c.stats["dropped"], "aggregated": c.stats["aggregated"],
                "batches": c.stats["batches"], "written_off": c.stats["written_off"], "ignored": dict(c.ignored),
                "rate_updates": self.driver.counters["rate_updates"] if self.driver else 0,
                "failed_workers": sorted(self.driver.failed) if self.driver else [], **self.counters}


async def server_run(ps) -> None:
    """Asynchronous training at PS shard ``ps`` through its schedule's controller (raises TrainingFailed)."""
    role = _ServerRole(ps)
    await role.run()


# -- worker ---------------------------------------------------------------------------------------------------------

async def worker_run(w) -> dict:
    """Train worker ``w`` under the PS's controller until STOP; returns its stats."""
    from .workloads import set_flat

    if w._batches is None:
        w._batches = w.workload.batches(w.cfg.rank, w.cfg.world_size, w.cfg.seed)
    if len(w.shards) != 1:
        raise RemoteError(f"worker {w.cfg.rank}: {w.planner.name} serves one PS shard, the job has {len(w.shards)}")
    ps = server_node(w.shards[0].shard)
    ch = ControlChannel(w.executor, ps, out_dir=UP, in_dir=DOWN, patience_s=w.cfg.pull_timeout_s,
                        epoch=w.join_tickets.get(w.shards[0].shard, 0))
    consumed = asyncio.Event()
    stats = {"dropped": 0, "grants": 0}

    def after_grant(g, reports) -> None:
        stats["grants"] += 1
        for s in g.steps:  # slots of a batch are used once: free them after their send
            if s.op == "send" and s.slot.startswith("mlf:"):
                w.slots._partials.pop(s.slot, None)
            if s.op == "combine" and s.src.startswith("mlf:") and s.src != s.dst:
                w.slots._partials.pop(s.src, None)
        if grant_uses_gradient(g):
            stats["dropped"] += int(g.drop)
            consumed.set()

    follower = GrantFollower(ch, w.slots, None, timeout_s=w.cfg.pull_timeout_s, after_grant=after_grant)
    pslots = Slots()
    pslots.bind("params", w._in[0])
    s0 = w.shards[0]

    async def compute_loop() -> dict:
        j = 0
        while True:
            t0 = time.monotonic()
            res = await w.executor.run(Program(w.node, ((Recv(ps, "params", 0, 0, params_tag(j, ch.epoch), RELIABLE,
                                                              "params",
                                                              timeout_s=w.cfg.pull_timeout_s),),)), pslots)
            r = res.reports[0]
            if not isinstance(r, RecvReport) or r.received_bytes == 0:
                raise TransportTimeout(f"worker {w.cfg.rank}: no parameters from the PS for "
                                       f"{time.monotonic() - t0:.1f} s ({getattr(r, 'regime', r)}; --pull-timeout "
                                       f"{w.cfg.pull_timeout_s:g} s)")
            h = ParamsHeader.unpack(w._in[0])
            if h.n_elems != s0.hi - s0.lo:
                raise RemoteError(f"shard {s0.shard} sent {h.n_elems} parameters, expected {s0.hi - s0.lo}")
            w.flat[s0.lo:s0.hi] = w._in[0][HEADER_BYTES:HEADER_BYTES + ELEM * h.n_elems].view(np.float32)
            if w.model is not None:
                set_flat(w.model, w.flat)
            batch = await asyncio.to_thread(next, w._batches)  # off the loop: a batch can take seconds
            grad, loss, samples = await asyncio.to_thread(w.workload.compute, w.model, batch)
            grad = np.asarray(grad, np.float32)
            w.slots.put_partial(SLOT_GRAD, Partial.of_gradient(grad, samples=samples, loss=loss))
            consumed.clear()
            await follower.report(NodeReady(w.node, j, 0, int(h.model_version), float(np.linalg.norm(grad))))
            w.last_loss = loss
            await consumed.wait()
            w.iterations += 1
            j += 1
            if w.cfg.max_iterations is not None and w.iterations >= w.cfg.max_iterations:
                return {"iterations": w.iterations, "last_loss": w.last_loss, "stopped": False, **stats}

    comp = asyncio.ensure_future(compute_loop())
    fol = asyncio.ensure_future(follower.run())
    try:
        done, _ = await asyncio.wait({comp, fol}, return_when=asyncio.FIRST_COMPLETED)
        if fol in done:
            fol.result()  # raises if the PS went silent
            return {"iterations": w.iterations, "last_loss": w.last_loss, "stopped": True, **stats}
        return comp.result()
    except TimeoutError as exc:
        if isinstance(exc, TransportTimeout):
            raise
        raise TransportTimeout(str(exc)) from exc
    finally:
        for t in (comp, fol):
            t.cancel()
        await asyncio.gather(comp, fol, return_exceptions=True)
