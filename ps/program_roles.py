"""PS and worker rounds for schedules whose programs the roles run whole (trees: ``rat``).

Theory of operation
-------------------
``direct`` keeps its hand-tuned PS loop (per-worker membership, error
feedback).  A schedule that aggregates on the way (a tree) gives the PS only
partials, so its round is simply its program, run end to end by the executor:

* PS shard ``s`` (:func:`server_round`): bind ``params`` to the parameter
  message, run ``plan(i).program("server:s")`` (parameters down the tree,
  partials up, ``Combine``), and its ``Apply`` handler takes the reduced
  partial's unbiased mean, applies the optimizer where anyone delivered
  (``counts > 0``; the divergence guard clips first) and bumps the version.
  STOP runs the same program's leading send-only stages with a STOP message.
  Health, as the direct PS: the PS's own transfers to and from its tree
  children feed ``Membership`` (a failed parameter send drops that child at
  once; a child whose partial does not arrive is "missed" and dropped after
  ``max_missed`` rounds in a row; dropped children are excluded from later
  rounds, so their sends are skipped and their receives do not wait), and
  every round goes through the PS's ``_check_health`` (non-finite loss or
  parameters, ``max_missed`` rounds in a row without an applied update); no
  live child left makes ``_run_bsp`` wait for rejoins and then fail, like the
  direct PS.  Timeouts per round: parameters get the derived broadcast bound,
  partials the gather bound (counted once the PS's own sends are done; its
  compute samples are the partial waits of complete rounds, so it covers the
  rest of the broadcast down the tree, the compute and the reduce), at least
  the broadcast floor.  The bound rides in the parameter header: aggregating
  workers wait for their children a ``1/(levels+1)`` share of it.
* Dead workers (``ltp_ps.tree_views``): with a board (every ``ltp-ps`` job),
  the trees are rebuilt without them, and with a live one again once it
  comes back; see the section at the end.
* Worker ``w`` (:func:`worker_run`): each round binds every raw ``params``
  slot of its program to its receive buffer for the shard whose range the
  step names, runs the program; ``Compute`` reads the parameter messages (a
  STOP ends the run after it has been forwarded down the tree), computes the
  gradient and stores it as a partial.  Forwarded parameter messages are sent
  at their received length.  A parameter message counts only when its reliable
  receive completed (a sender that gives up cancels the transfer and the
  receiver zero-fills the rest: never trained on); a worker whose copy is not
  whole relays an empty message (header only, ``n_elems = 0``) so its children
  know at once to compute on the parameters they hold.
* A stalled child must not make its aggregator late (the PS would drop the
  live aggregator and its subtree; seen with a SIGSTOPped leaf): an
  aggregator's parameter relay is bounded by the same ``1/(levels+1)`` share
  of the round bound as its wait for partials, and it waits for partials only
  from the children its relay reached (``only_if``); the PS likewise waits only
  for the children its parameter send reached.  A child that keeps failing
  becomes a suspect and the trees are repaired around it.
* A stalled *parent* must not make its children late in the other trees
  (with K trees every aggregator is a leaf of the others): once a worker
  holds a parameter message of the round, a relay still missing gets one
  level's share more, then it is cut off (``straggler_bound``); and the PS's
  farthest-first send stages each get that share before the next starts
  beside them, a child missing rounds no more than the share for its
  parameters (``_late_children``).

Workers need each other's addresses (a tree's edges join workers); the CLI
publishes them through the store (``schedule_cli``).  Round numbers: workers
count rounds from the PS's first round (0, or the resumed iteration given
as ``start``); a worker declared dead while alive comes back through the board
(``tree_views``, "Coming back"); a first join mid-run is not supported by tree schedules.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np

from . import tree_views
from .deadlines import BROADCAST_FLOOR_S
from .errors import Excluded, PeerGone, RemoteError, TrainingFailed, TransportTimeout
from .membership import State
from .schedules.executor import MIN_TIMEOUT_S, STOP, ExecutorError
from .schedules.partial import Partial, assemble
from .schedules.program import Program, parse_node, worker as worker_node
from .transport.base import CANCELLED, TIMEOUT, RecvReport
from .wire import ELEM, HEADER_BYTES, KIND_PARAMS, KIND_STOP, ParamsHeader, tag_of


class _ServerHandlers:
    def __init__(self, ps, it: int):
        self.ps, self.it = ps, it
        self.partial: Partial | None = None
        self.applied = False  # an optimizer step was taken this round
        self._pieces: dict = {}  # (lo, hi) -> the reduced partial of that piece (cut-through trees)

    def apply(self, step, slots):
        ps = self.ps
        p = slots.partial(step.slot, step.lo, step.hi)
        if (step.lo, step.hi) != (ps.lo, ps.hi):
            # a cut-through tree (``--rat-chunks``) reduces the slice in pieces, one Apply each: the
            # optimizer steps once, on the whole slice, when the last piece is in
            self._pieces[(step.lo, step.hi)] = p
            if sum(b - a for a, b in self._pieces) < ps.hi - ps.lo:
                return None
            p = assemble(self._pieces, ps.lo, ps.hi - ps.lo)
        self.partial = p
        if p is None or p.contributors == 0:
            return None
        grad = p.mean(ps.cfg.aggregation)
        counts = p.counts()
        if not np.isfinite(grad.sum(dtype=np.float32)):
            ps.log(f"[ps{ps.shard}] round {self.it}: the aggregated gradient is not finite; update skipped")
            return None
        mask = None if (counts > 0).all() else counts > 0
        ps._clip_scale = ps.guard.apply(grad, mask)
        ps.optimizer.step(grad, mask=mask)
        ps.version += 1
        self.applied = True
        return None


def _late_children(prog: Program, late, share_s: float) -> Program:
    """The PS's program with each parameter send to a child in ``late`` (missing rounds) bounded by ``share_s``
    (one level's share of the round bound, as a worker's relay).

    A tree's PS sends to its farthest subtree first, a stage of its own, so that the long path starts early. A
    child that stopped answering (SIGSTOP) then held every later send of the round, and the round, for the
    send's whole bound: the PS's other children reached the other shards that late, and the other shards
    dropped them (in memory, racks [4, 4] with K = 4: the stalled worker's four live rack peers).  The head start
    (``Executor.run``) bounds the first such round; this, the rounds after it."""
    if not late:
        return prog
    return Program(prog.node, tuple(
        tuple(_with_timeout(s, share_s) if s.op in ("send", "forward") and s.payload == "params" and s.peer in late
              else s for s in st) for st in prog.stages))


def _levels(plan) -> int:
    """The aggregation levels of a round's trees (``RoundPlan.notes``; 1 when the schedule names none)."""
    return max(1, int(plan.notes.get("levels", 1))) if isinstance(plan.notes, dict) else 1


def _level_share(bound_s: float, levels: int) -> float:
    """One tree level's share of a round bound: what each hop (the PS's send, a relay, an aggregator's wait for
    its children's partials) may take, so that ``levels + 1`` hops fit in the PS's bound."""
    return max(MIN_TIMEOUT_S, bound_s / (max(1, levels) + 1))


def _send_only_prefix(prog: Program) -> Program:
    out = []
    for st in prog.stages:
        if any(s.op == "recv" for s in st):
            break
        out.append(st)
    return Program(prog.node, tuple(out))


async def server_round(ps) -> dict:
    """One round of a program-driven schedule at PS shard ``ps``; returns its metrics row."""
    it = ps.iteration
    views = _views(ps)
    if views is not None:
        await asyncio.to_thread(_sync_server_views, ps, views, it)
    members = ps.membership.active()
    ps.transport.discard_before(tag_of(it, 0))
    msg = ps._params_message(KIND_PARAMS, {})
    bt = ps.deadline.broadcast_timeout(len(msg), len(members))
    # partials: the gather rule, counted from the PS's partial stage (its own parameter sends are done by
    # then), whose "compute" samples are whole partial waits of complete rounds (the rest of the tree's
    # broadcast, the compute, the reduce); at least the broadcast floor unless --gather-timeout fixes it (a
    # child is dropped for good after --max-missed misses, so a straggler throttled for seconds must not miss)
    bound = ps.deadline.timeout(len(msg), len(members))
    if ps.deadline.fixed_s is None:
        bound = max(BROADCAST_FLOOR_S, bound)
    msg = ps._params_message(KIND_PARAMS, {}, round_bound_s=bound)  # aggregating workers wait a share of it
    ps._address(members)
    ps._slots.bind("params", msg)
    ps._slots.clear_partials()
    plan = ps.planner.plan(it)
    prog = plan.program(ps.node)
    # a stalled child must not hold the round (see _late_children): a send stage gets one level's share of the
    # bound to finish before the next starts beside it, and a child missing rounds gets that share, no more
    share = _level_share(bound, _levels(plan))
    late = {worker_node(r) for r, m in ps.membership.members.items() if m.state is State.ACTIVE and m.missed}
    prog = _late_children(prog, late, share)
    ps.executor.payload_timeouts.update(params=bt, partial=bound)
    dead = {worker_node(r) for r, m in ps.membership.members.items() if m.state is not State.ACTIVE}
    h = _ServerHandlers(ps, it)
    t0 = time.monotonic()
    res = await ps.executor.run(prog, ps._slots, h, iteration=it, exclude=dead, head_start_s=share)
    wall = time.monotonic() - t0
    _observe_partial_wait(ps, prog, res)
    n_active = len(ps.membership.active())
    _observe_children(ps, it, prog, res, dead, wall, bound)
    # a tree being repaired may deliver nothing for a few rounds: not the job's failure (bounded: the lag)
    repairing = views is not None and (len(ps.membership.active()) < n_active
                                       or views.tracker.newest.from_round > it)
    p = h.partial
    contributors = p.contributors if p is not None else 0
    loss = p.loss_sum / contributors if contributors else float("nan")
    frac = float(p.counts().mean()) / max(1, len(members)) if p is not None and p.n else 0.0
    ps.iteration += 1
    row = {"event": "iteration", "t": time.time(), "shard": ps.shard, "iteration": it, "epoch": it // ps.ipe,
           "workers": len(members), "contributors": contributors, "gather_s": wall, "gather_wait_s": wall,
           "broadcast_s": None,  # not timed apart: the tree's program carries the parameters down inside gather_s
           "round_s": wall, "delivered": {"all": frac}, "regime": {}, "bubbles": {},
           "lost_elements": {}, "missing_steps": len(res.missing), "loss": loss,
           "samples": p.samples if p is not None else 0, "schedule": ps.planner.name}
    ps._write_member_events(it)
    ps.metrics.write(row)
    ps._check_health(it, [loss] if contributors else [], h.applied, len(ps.membership.active()), bound,
                     excused=repairing)
    return row


def _observe_partial_wait(ps, prog: Program, res) -> None:
    """A round in which every partial arrived whole is a sample of how long the partials take to come up."""
    recvs = [(st, rep) for st, rep in zip(prog.steps(), res.reports) if st.op == "recv" and st.payload == "partial"]
    if recvs and all(isinstance(rep, RecvReport) and rep.ok for _, rep in recvs):
        waits = [res.group_s[st.group] for st, _ in recvs if st.group in res.group_s]
        if waits:
            ps.deadline.observe_compute(max(waits))


def _observe_children(ps, it: int, prog: Program, res, dead: set, wall: float, bound: float) -> None:
    """Membership from the PS's own transfers with its tree children (as the direct PS does per worker)."""
    seen: dict = {}  # rank -> delivered a partial this round (True) / failed (reason)
    for step, rep in zip(prog.steps(), res.reports):
        if step.op not in ("send", "recv") or step.peer in dead:
            continue
        role, rank = parse_node(step.peer)
        if role != "worker":
            continue
        if step.op == "send" and isinstance(rep, PeerGone):  # hard evidence: ICMP unreachable, refused, reset
            why = f"parameters of round {it} failed after {wall:.2f} s: {type(rep).__name__}: {rep}"
            ps.membership.failed(rank, why)
            ps.log(f"[ps{ps.shard}] dropped worker {rank}: {why}")
        elif step.op == "send" and isinstance(rep, BaseException) and not isinstance(rep, ExecutorError):
            # a timeout or refusal: a straggler (a throttled host) looks the same; dropped from the trees for
            # good only after --max-missed rounds in a row
            seen[rank] = f"its parameters failed ({type(rep).__name__}: {rep})"
        elif step.op == "recv" and step.payload == "partial" and seen.get(rank, True) is True:
            ok = isinstance(rep, RecvReport) and rep.received_bytes > 0
            if ok or rep is None or getattr(rep, "regime", None) not in (TIMEOUT, CANCELLED):
                seen.setdefault(rank, True)  # alive (it registered), even if Early Close left nothing usable
            else:
                elapsed = rep.duration_s if rep.duration_s > 0 else wall
                seen[rank] = (f"no partial within {elapsed:.2f} s ({rep.regime}; bound {bound:.2f} s)"
                              if rep.regime == TIMEOUT else
                              f"its partial's transfer failed after {elapsed:.2f} s (peer closed or unreachable)")
    for rank, v in seen.items():
        if v is True:
            ps.membership.delivered(rank)
        elif ps.membership.missed(rank, v):
            ps.log(f"[ps{ps.shard}] dropped worker {rank}: {v} {ps.cfg.max_missed} rounds in a row")


async def server_stop(ps, timeout: float) -> None:
    """STOP down the schedule's parameter path (the leading send-only stages of the next round's program).

    With a view board, ``stop`` is posted there first: a worker waiting on a round no parameters will come
    for (an orphan of a dead aggregator) stops on it."""
    views = _views(ps)
    if views is not None:
        try:
            await asyncio.to_thread(views.board.post_stop, ps.iteration)
        except Exception as exc:  # the store is gone: STOP through the trees still reaches the live ones
            ps.log(f"[ps{ps.shard}] could not post stop on the tree-view board: {exc}")
    members = ps.membership.active()
    ps._address(ps.membership.members.values())
    ps._slots.bind("params", ps._params_message(KIND_STOP, {}))
    prog = _send_only_prefix(ps.planner.plan(ps.iteration).program(ps.node))
    prog = Program(prog.node, tuple(tuple(_with_timeout(s, timeout) for s in st) for st in prog.stages))
    live = {worker_node(m.rank) for m in members}
    dead = {s.peer for s in prog.steps() if s.op in ("send", "forward") and s.peer not in live}
    await ps.executor.run(prog, ps._slots, iteration=ps.iteration, exclude=dead)


def _with_timeout(step, timeout):
    return dataclasses.replace(step, timeout_s=timeout) if hasattr(step, "timeout_s") else step


class _WorkerHandlers:
    def __init__(self, w, it: int, levels: int = 1, param_sources=frozenset(), param_slots=None):
        self.w, self.it, self.levels = w, it, max(1, int(levels))
        self.param_sources = set(param_sources)  # the nodes this round's parameter slices come from
        self.param_slots = dict(param_slots or {})  # receive slot -> index of the shard (w.shards) it holds
        self.stopped = False
        self.orphaned = False  # every parameter source was declared dead: no gradient this round
        self.sources_gone = False  # every parameter source is a worker whose connection closed (not yet declared)
        self.computed = False  # this round's gradient was computed (on the parameters held, maybe stale ones)

    def _whole(self, slots, i: int) -> bool:
        """False when this round's parameter receive for shard index ``i`` ended incomplete."""
        return not any(k == i and _cut_short(slots, slot) for slot, k in self.param_slots.items())

    def straggler_bound(self, steps, slots, arrived=None):
        """The executor's straggler rule for this round's parameter receives from relaying workers: once this
        worker holds a parameter message of the round (``arrived``, or one received in an earlier stage), the
        other relays get one level's share of the round bound more (see the module docstring); None when the
        group is not parameters from workers or no message of this round is held yet."""
        if any(s.payload != "params" or parse_node(s.peer)[0] != "worker" for s in steps):
            return None  # a PS's message is never cut off (and skipping the PS would skip its partial too)
        if arrived is not None:
            held = [arrived]
        else:
            mine = {s.slot for s in steps}
            held = [slots.buffer(slot) for slot in self.param_slots
                    if slot not in mine and not _cut_short(slots, slot)]
        for buf in held:
            try:
                h = _fresh_header(buf, self.it)
            except RemoteError:
                continue
            if h is not None and h.kind != KIND_STOP and h.round_bound_ms:
                return _level_share(h.round_bound_ms / 1000.0, self.levels)
        return None

    def prepare_transfer(self, step, slots):
        """A relay of parameters (``Forward``): bounded by this level's share of the round bound, and an empty
        message instead of a copy that did not arrive whole (see the module docstring)."""
        if step.op != "forward" or step.payload != "params" or step.slot not in self.param_slots:
            return None
        w, i = self.w, self.param_slots[step.slot]
        buf = slots.buffer(step.slot)
        h = _fresh_header(buf, self.it)
        if h is not None and h.round_bound_ms:
            w.relay_budget_s = _level_share(h.round_bound_ms / 1000.0, self.levels)
        budget = w.relay_budget_s
        if h is not None and h.kind == KIND_STOP:
            return None  # STOP goes down as it came (bounded by the PS's own stop timeout)
        if h is None or h.n_elems == 0 or _cut_short(slots, step.slot):
            empty = f"{step.slot}:empty"
            msg = np.zeros(HEADER_BYTES, np.uint8)
            ParamsHeader(KIND_PARAMS, w.shards[i].shard, self.it, h.model_version if h else 0, 0, 0,
                         h.epoch if h else 0, h.round_bound_ms if h else 0).pack_into(msg)
            slots.bind(empty, msg)
            w.empty_relays += 1
            return dataclasses.replace(step, slot=empty, timeout_s=budget)
        return dataclasses.replace(step, timeout_s=budget) if budget is not None else None

    async def compute(self, step, slots):
        w = self.w
        headers, stale, heard = [], [], 0
        for i, (s, buf) in enumerate(zip(w.shards, w._in)):
            h = _fresh_header(buf, self.it)
            if h is not None and h.kind == KIND_STOP:
                self.stopped = True
                return STOP
            heard += h is not None  # this round's message came, if maybe not whole
            if h is None or h.n_elems == 0 or not self._whole(slots, i):
                # this shard's parameters did not come down the tree whole this round (a parameter hop timed
                # out: e.g. a throttled aggregator; or an aggregator relayed an empty message): compute on the
                # slice held from an earlier round (the initial parameters before the first), as a stale
                # gradient, rather than fail or train on a zero-filled copy
                stale.append(s.shard)
                continue
            if h.n_elems != s.hi - s.lo:
                raise RemoteError(f"worker {w.cfg.rank}: shard {s.shard} sent round {h.iteration} with "
                                  f"{h.n_elems} parameters, expected {s.hi - s.lo}")
            w.flat[s.lo:s.hi] = buf[HEADER_BYTES:HEADER_BYTES + ELEM * h.n_elems].view(np.float32)
            headers.append(h)
        bound_s = max((h.round_bound_ms for h in headers), default=0) / 1000.0
        if bound_s > 0:
            # an aggregating worker must send its partial up before its parent gives up on it: each level of
            # the tree waits for its children a 1/(levels+1) share of the PS's bound for the round
            w.executor.payload_timeouts["partial"] = _level_share(bound_s, self.levels)
        if stale:
            if len(stale) == len(w.shards) and not heard:
                if self.param_sources and w.executor.excluded >= self.param_sources:
                    self.orphaned = True  # every parameter source was declared dead during the round
                    return None
                if self.param_sources and all(parse_node(p)[0] == "worker" for p in self.param_sources) and \
                        all(_gone(slots.reports.get(slot)) for slot in self.param_slots):
                    # hard evidence (a TCP peer's connection closed) before the job's word on the board: the
                    # round loop waits for the board to declare them (worker_run), instead of failing the worker
                    self.sources_gone = True
                    return None
                raise TransportTimeout(f"worker {w.cfg.rank}: no parameters of any shard for round {self.it}")
            if not w.stale_param_slices and not self.it:
                w.flat[:] = w.workload.initial_params(w.cfg.seed)  # what the PS starts from (same --seed)
                for s, buf in zip(w.shards, w._in):  # ... and the slices that did come this round
                    if s.shard not in stale:
                        w.flat[s.lo:s.hi] = buf[HEADER_BYTES:HEADER_BYTES + ELEM * (s.hi - s.lo)].view(np.float32)
            w.stale_param_slices += len(stale)
            print(f"[w{w.cfg.rank}] round {self.it}: no parameters from shard(s) {stale} in time; computing on the "
                  f"previous ones (stale slices so far: {w.stale_param_slices})", flush=True)
        if w.model is not None:
            from .workloads import set_flat

            set_flat(w.model, w.flat)
        batch = await asyncio.to_thread(next, w._batches)  # off the loop: a batch can take seconds
        grad, loss, samples = await asyncio.to_thread(w.workload.compute, w.model, batch)
        slots.clear_partials()
        slots.put_partial(step.slot, Partial.of_gradient(np.asarray(grad, np.float32), samples=samples, loss=loss))
        w.last_loss = loss
        self.computed = True
        return None


def _gone(report) -> bool:
    """A transfer's report (or error) that says the peer is gone (connection closed, unreachable)."""
    return isinstance(report, ConnectionError) or getattr(report, "peer_gone", False)


def _cut_short(slots, slot: str) -> bool:
    """True when this round's reliable receive into ``slot`` ended before the whole message arrived (the rest
    of the buffer is zero-filled, not parameters)."""
    r = slots.reports.get(slot)
    return isinstance(r, RecvReport) and not r.complete


def _fresh_header(buf, it: int) -> ParamsHeader | None:
    """The parameter message header in ``buf`` if it is this round's (or a STOP), else None (nothing or an
    earlier round's message is there: the receive did not complete)."""
    try:
        h = ParamsHeader.unpack(buf)
    except RemoteError:
        return None  # never written (zeros)
    if h.kind == KIND_STOP or h.iteration == it:
        return h
    if h.iteration > it:
        raise RemoteError(f"parameter message of round {h.iteration} while running round {it}")
    return None


async def worker_run(w, start: int = 0) -> dict:
    """Train worker ``w`` on its schedule's programs until STOP."""
    if w._batches is None:
        w._batches = w.workload.batches(w.cfg.rank, w.cfg.world_size, w.cfg.seed)
    views = _views(w)
    it = start
    while True:
        if views is not None:
            await _settle(views)  # the look the last round left on its way: no two board accesses at once
            if await _await_decided(w, views, it):
                return {"iterations": w.iterations, "last_loss": w.last_loss, "stopped": True}
            what = await asyncio.to_thread(_sync_worker_views, w, views, it)
            if what == ROUND_STOP:
                return {"iterations": w.iterations, "last_loss": w.last_loss, "stopped": True}
            if what == ROUND_OUT:
                w.out_rounds += 1
                it += 1
                continue
        plan = w.planner.plan(it)
        prog = plan.program(w.node)
        excluded = views.excluded(it) if views is not None else set()
        sources = {st.peer for st in prog.steps() if st.op == "recv" and st.payload == "params"}
        if sources and sources <= excluded:
            # an orphan round: every parameter slice would come through a dead worker, and the trees without it
            # start later; nothing can come down and nothing is worth sending up, so do not wait or compute
            _orphan_round(w, it, sources, f"the repaired trees start at round {views.tracker.newest.from_round}")
            it += 1
            continue
        param_slots = {}
        for st in prog.steps():
            if st.op in ("recv", "forward") and st.payload == "params":
                i = next(k for k, s in enumerate(w.shards) if (s.lo, s.hi) == (st.lo, st.hi))
                w.slots.bind(st.slot, w._in[i])
                param_slots[st.slot] = i
        h = _WorkerHandlers(w, it, _levels(plan), sources, param_slots)
        run = w.executor.run(prog, w.slots, h, iteration=it, exclude=excluded)
        if views is None:
            res = await run
        else:
            res = await _run_watched(w, views, run, prog, it)
            if res is None:  # the PS has stopped (posted on the board) while this round waited
                return {"iterations": w.iterations, "last_loss": w.last_loss, "stopped": True}
            if res is DECLARED_DEAD:  # the next round's board sync steps it out and asks to come back
                it += 1
                continue
            fresh = _observe_peers(w, views, prog, res, it)
            if fresh:
                await _settle(views)
                await asyncio.to_thread(_post_suspects, w, views, fresh)
        if h.stopped or res.stopped:
            return {"iterations": w.iterations, "last_loss": w.last_loss, "stopped": True}
        _report_missing_partials(w, it, prog, res, excluded)
        if h.orphaned:
            _orphan_round(w, it, sources, "declared dead while this round waited for them")
            it += 1
            continue
        if h.sources_gone:
            if views is not None and await _declared_dead(w, views, sources):
                _orphan_round(w, it, sources, "their connections closed; the job declared them dead")
                it += 1
                continue
            raise TransportTimeout(f"worker {w.cfg.rank}: no parameters of any shard for round {it}: "
                                   f"{sorted(sources)} closed their connections, and the job did not declare them "
                                   f"dead within --pull-timeout ({w.cfg.pull_timeout_s:g} s)")
        first = [r for st, r in zip(prog.steps(), res.reports) if st.op == "recv" and st.payload == "params"]
        # a round that computed had a parameter message of its own, if cut short (a relay that died mid-message:
        # its receive was abandoned, and its report counts no bytes though the header and part of the slice came)
        if first and not h.computed and all(getattr(r, "received_bytes", 0) == 0 for r in first):
            raise TransportTimeout(f"worker {w.cfg.rank}: no parameters for round {it} within "
                                   f"{w.cfg.pull_timeout_s} s")
        w.iterations += 1
        it += 1
        if w.cfg.max_iterations is not None and w.iterations >= w.cfg.max_iterations:
            return {"iterations": w.iterations, "last_loss": w.last_loss, "stopped": False}


async def _declared_dead(w, v: "_Views", nodes) -> bool:
    """Wait (up to ``--pull-timeout``, looking every ``BOARD_POLL_S``) until the board declares every node of
    ``nodes`` dead, or the PS posts stop (the next round's board sync ends the run); False if neither came."""
    deadline = time.monotonic() + w.cfg.pull_timeout_s
    await _settle(v)
    while True:
        stop, newest = await asyncio.to_thread(_poll_board, v)
        if stop is not None or set(nodes) <= {worker_node(r) for r in newest.dead}:
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(tree_views.BOARD_POLL_S)


def _report_missing_partials(w, it: int, prog: Program, res, excluded) -> None:
    """An aggregating worker says which children's partials it went up without, with the executor's reason
    (nothing came, and how long it waited; not waited for, because its parameter hop did not reach the child or
    the child was abandoned; the partial could not be decoded): in the first round that happens and then
    whenever the number of such rounds doubles, so a lossy run is not a line a round.  Children known dead
    (``excluded``) are not news."""
    steps = prog.steps()
    missed = {}
    for i, why in res.missing:
        st = steps[i]
        if st.op != "recv" or st.payload != "partial" or st.peer in excluded:
            continue
        took = getattr(res.reports[i], "duration_s", 0.0)
        missed[st.peer] = f"{getattr(why, 'value', why)}" + (f" after {took:.3f} s" if took else "")
    if not missed:
        return
    w.short_partial_rounds += 1
    n = w.short_partial_rounds
    if n & (n - 1) == 0:
        print(f"[w{w.cfg.rank}] round {it}: sent its partial up without "
              + ", ".join(f"{p} ({why})" for p, why in sorted(missed.items()))
              + f"; rounds with a child's partial missing so far: {n}", flush=True)


def _orphan_round(w, it: int, sources, why: str) -> None:
    w.orphan_rounds += 1
    print(f"[w{w.cfg.rank}] round {it}: no parameters can come: {sorted(sources)} are dead ({why}); "
          f"no gradient this round", flush=True)


# -- tree views: repairing the trees around dead workers (ltp_ps.tree_views) ------------------------------------------

class _Views:
    """One process's tree-view state: its board (the I/O) and ``tree_views``' sans-IO objects."""

    def __init__(self, board, base_world, max_missed: int):
        self.board = board
        self.base = base_world  # the job's world: every repair is planned from it
        self.tracker = tree_views.ViewTracker()
        self.suspicion = tree_views.Suspicion(max_missed)
        self.applied: frozenset = frozenset()  # the dead set the planner's world is built without
        self.posted: set = set()  # (rank, generation) pairs this process posted as suspects
        self.started = False
        self.decided = -1  # PS shard 0's decided-through mark, as last read (or written, at shard 0)
        self.max_returns = tree_views.MAX_RETURNS  # --max-returns (set by _views from the role's config)
        self.revived: dict = {}  # PS: rank -> the generation its membership was taken back for
        self.asked = 0  # worker: the generation it asked to come back as (0: none)
        # worker: the decided-through mark of the last look that read the newest view after it (board.look),
        # and the stop that look saw: a round up to ``synced`` needs no look of its own before it runs
        self.synced = -1
        self.stop: int | None = None
        self.looking: asyncio.Future | None = None  # a look beside the round, not yet taken in (_settle)

    def excluded(self, round_: int) -> set:
        """Nodes not sent to nor waited for in round ``round_``: its view's dead, and the newest view's (known
        dead, also in rounds before that view takes effect; a worker coming back stays out until its round)."""
        return {worker_node(r) for r in self.tracker.dead_for(round_) | self.tracker.newest.dead}

    def apply(self, planner, round_: int) -> frozenset | None:
        """Plan round ``round_`` without its view's dead workers; the new dead set if it changed."""
        dead = self.tracker.dead_for(round_)
        if dead == self.applied or not [r for r in self.base.workers if r not in dead]:
            return None
        planner.set_world(self.base.without(dead))
        self.applied = dead
        return dead


def _views(role) -> _Views | None:
    """The role's view state (made on first use); None without a board (``role.tree_board``)."""
    v = getattr(role, "_tree_views", None)
    if v is None and getattr(role, "tree_board", None) is not None:
        v = role._tree_views = _Views(role.tree_board, role.planner.world, getattr(role.cfg, "max_missed", 3))
        v.max_returns = getattr(role.cfg, "max_returns", tree_views.MAX_RETURNS)
    return v


def _sync_server_views(ps, v: _Views, it: int) -> None:
    """PS side, at the start of round ``it`` (blocking board I/O; run off the loop)."""
    board = v.board
    if not v.started:
        v.tracker.learn(board.latest())  # a restarted shard continues the board's numbering
        v.decided = board.decided()  # ... and never takes back a round an earlier incarnation declared final
        board.clear_stop()  # an earlier incarnation's stop: this one runs on
        v.started = True
    ranks = set(v.base.workers)
    newest = v.tracker.newest
    dropped = {(r, newest.gen(r)) for r, m in ps.membership.members.items()
               if m.state is not State.ACTIVE and r in ranks}
    if ps.shard != 0:
        for r, g in sorted(dropped - v.posted):
            board.suspect(r, ps.node, f"dropped by {ps.node}", gen=g)
            v.posted.add((r, g))
        _wait_decided(ps, v, it)
        v.tracker.learn(board.latest())
    else:
        suspects = {s for s in board.suspicions() if s[0] in ranks} | dropped
        view = tree_views.next_view(newest, suspects, it, v.decided, backs=board.backs(), max_returns=v.max_returns)
        if view is not None:
            board.publish(view)
            v.tracker.learn(view)
            back = sorted(newest.dead - view.dead)
            ps.log(f"[ps{ps.shard}] round {it}: tree view {view.number}: workers {sorted(view.dead)} are dead"
                   + (f", workers {back} come back" if back else "")
                   + f"; the trees are rebuilt from round {view.from_round}")
        if tree_views.decided_through(it) > v.decided:  # after the view: a reader of the mark finds the view
            v.decided = tree_views.decided_through(it)
            board.post_decided(v.decided)
    newest = v.tracker.newest
    for r, g, since in newest.returns:  # taken back: a member again (its rounds are planned with it from `since`)
        m = ps.membership.members.get(r)
        if g > v.revived.get(r, 0) and r not in newest.dead and m is not None:
            v.revived[r] = g
            if m.state is State.ACTIVE:
                continue  # a restarted shard learning the board: the worker joined it as a member already
            ps.membership.admit(r, m.addr, iteration=since)
            ps.log(f"[ps{ps.shard}] round {it}: worker {r} is taken back into the trees (generation {g}) from round "
                   f"{since}")
    for r in sorted(newest.dead):
        ps.membership.failed(r, f"excluded from the trees (tree view {newest.number})")
    dead = v.apply(ps.planner, it)
    if dead is not None:
        ps.log(f"[ps{ps.shard}] round {it}: planning the trees without workers {sorted(dead)}")


def _wait_decided(ps, v: _Views, it: int) -> None:
    """PS shard > 0, before round ``it`` (blocking): wait until shard 0 has declared round ``it``'s view final
    (``tree_views``: the decided-through mark), at most ``join_timeout_s`` or ``SHARD0_WAIT_MIN_S``."""
    wait_s = max(ps.cfg.join_timeout_s, tree_views.SHARD0_WAIT_MIN_S)
    deadline = time.monotonic() + wait_s
    while v.decided < it:
        v.decided = v.board.decided()
        if v.decided >= it:
            return
        if time.monotonic() >= deadline:
            raise TrainingFailed(f"PS shard {ps.shard}: PS shard 0 has not started round "
                                 f"{it - tree_views.VIEW_LAG_ROUNDS} within {wait_s:g} s, so the trees "
                                 f"of round {it} are not known (is PS shard 0 alive? see its log)")
        time.sleep(tree_views.DECIDED_POLL_S)


async def _await_decided(w, v: _Views, it: int) -> bool:
    """Worker, before round ``it``: wait until PS shard 0 has declared round ``it``'s view final (at most
    ``--pull-timeout``); True if the PS posted ``stop`` for this round meanwhile."""
    deadline = time.monotonic() + w.cfg.pull_timeout_s
    while v.decided < it:
        v.decided, stop = await asyncio.to_thread(_poll_decided, v, it)
        if v.decided >= it:
            return False
        if stop is not None and it >= stop:
            return True
        if time.monotonic() >= deadline:
            raise TransportTimeout(f"worker {w.cfg.rank}: PS shard 0 has not started round "
                                   f"{it - tree_views.VIEW_LAG_ROUNDS} within --pull-timeout "
                                   f"({w.cfg.pull_timeout_s:g} s), so the trees of round {it} are not known")
        await asyncio.sleep(tree_views.DECIDED_POLL_S)
    return False


def _poll_decided(v: _Views, it: int):
    decided = v.board.decided()
    return decided, (v.board.stopped_at() if decided < it else None)


#: what a worker does with a round (:func:`_sync_worker_views`)
ROUND_RUN, ROUND_OUT, ROUND_STOP = "run", "out", "stop"


def _sync_worker_views(w, v: _Views, it: int) -> str:
    """Worker side, before round ``it`` (blocking board I/O): :data:`ROUND_STOP` if the PS has stopped,
    :data:`ROUND_OUT` while this worker is declared dead (it asks to come back, once per generation, and steps
    through the rounds until a view takes it back: ``tree_views``, "Coming back"), else :data:`ROUND_RUN`."""
    rank = w.cfg.rank
    if v.synced >= it and rank not in v.tracker.newest.dead and not v.asked:
        # the look beside the last round read round ``it``'s view (final: decided through ``synced``): no store
        # round trip before this round (each one is a network round trip to the store's host)
        stop, newest = v.stop, v.tracker.newest
    else:
        stop, newest = _poll_board(v)
    if stop is not None and it >= stop:
        return ROUND_STOP
    if rank in newest.dead:
        gen = newest.gen(rank) + 1
        if gen > v.max_returns:
            raise Excluded(f"worker {rank}: the job declared this worker dead (tree view {newest.number}, from round "
                           f"{newest.from_round}: it missed its tree peers --max-missed rounds in a row) after taking "
                           f"it back {gen - 1} times (--max-returns {v.max_returns}); it stays out")
        if v.asked < gen:
            v.asked = gen
            v.board.ask_back(rank, gen)
            print(f"[w{rank}] round {it}: declared dead (tree view {newest.number}); asking to come back "
                  f"(generation {gen})", flush=True)
        return ROUND_OUT
    if rank in v.tracker.dead_for(it) or it < newest.since(rank):
        return ROUND_OUT  # taken back from a later round: until then the trees are planned without it
    if v.asked and v.asked == newest.gen(rank):
        v.asked = 0
        w.returns += 1
        v.suspicion = tree_views.Suspicion(v.suspicion.max_missed)  # what it saw while it was out means nothing
        print(f"[w{rank}] round {it}: back in the trees (generation {newest.gen(rank)}) after {w.out_rounds} "
              f"rounds out", flush=True)
    dead = v.apply(w.planner, it)
    if dead is not None:
        print(f"[w{rank}] round {it}: planning the trees without workers {sorted(dead)}", flush=True)
    return ROUND_RUN


#: :func:`_run_watched`'s answer when the board declared this worker itself dead while its round ran
DECLARED_DEAD = "declared dead"


async def _run_watched(w, v: _Views, run, prog: Program, it: int):
    """Run one round while looking at the board beside it, at its start and then every ``BOARD_POLL_S``: a
    peer of the round declared dead meanwhile is abandoned (no more waiting for it); returns the round's result,
    None when the PS posted ``stop``, or :data:`DECLARED_DEAD` when this worker was (the round is cancelled:
    nothing more will come).  The first look also holds the next round's view (``_Views.synced``), so the next
    round starts without a store round trip (it is skipped when an earlier look holds that view already).  A look
    still on its way when the round ends is left to finish and taken in by the next board access
    (:func:`_settle`), never waited for here."""
    task = asyncio.ensure_future(run)
    peers = {st.peer for st in prog.steps() if st.op in ("send", "recv", "forward")}
    loop = asyncio.get_running_loop()
    # the first look at once, unless an earlier one already holds the next round's view
    next_look = loop.time() + (tree_views.BOARD_POLL_S if v.synced >= it + 1 else 0.0)
    try:
        while True:
            if v.looking is None and loop.time() >= next_look:
                v.looking = asyncio.ensure_future(asyncio.to_thread(v.board.look))
            waits = {task} if v.looking is None else {task, v.looking}
            timeout = None if v.looking is not None else max(0.0, next_look - loop.time())
            done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            if v.looking is None or not v.looking.done():
                continue
            look, v.looking = v.looking, None
            next_look = loop.time() + tree_views.BOARD_POLL_S
            stop, newest = _take_look(v, look.result())
            if stop is not None:
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
                return None
            if w.cfg.rank in newest.dead:  # declared dead itself: nothing of this round will come; step out
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
                return DECLARED_DEAD
            gone = peers & {worker_node(r) for r in newest.dead}
            if gone - w.executor.excluded:
                print(f"[w{w.cfg.rank}] round {it}: {sorted(gone)} declared dead; no longer waiting for them",
                      flush=True)
                w.executor.abandon(gone)
    finally:
        if not task.done():
            task.cancel()


async def _settle(v: _Views) -> None:
    """Take in the look at the board :func:`_run_watched` left on its way (raises what the look raised)."""
    look, v.looking = v.looking, None
    if look is not None:
        _take_look(v, await look)


def _take_look(v: _Views, look):
    """Take in a board's ``look()`` (``(decided, stop, newest view)``); returns ``(stop, newest view)``."""
    decided, stop, view = look
    v.tracker.learn(view)
    v.decided = max(v.decided, decided)
    v.synced = max(v.synced, decided)
    v.stop = stop
    return stop, v.tracker.newest


def _poll_board(v: _Views):
    """A look at the board now (blocking): ``(stop, newest view)``."""
    return _take_look(v, v.board.look())


def _observe_peers(w, v: _Views, prog: Program, res, it: int) -> list:
    """Feed round ``it``'s exchanges with worker peers to the suspicion (about each peer's generation in the
    newest view); the ranks that became suspects now."""
    excluded = v.excluded(it)
    # a send that completed proves the peer alive only where the transport says so (not kernel TCP, whose buffers
    # take a paused peer's share for many rounds: its tree parent went on "hearing" it and never suspected it)
    sends_prove = w.transport.sends_confirm_peer
    oks: dict = {}  # rank -> any exchange with it succeeded this round
    whys: dict = {}  # rank -> the first failure
    gone: set = set()  # ranks a send or receive found gone (unreachable, connection closed): suspects at once
    for step, rep in zip(prog.steps(), res.reports):
        if step.op not in ("send", "recv", "forward") or step.peer in excluded:
            continue
        role, rank = parse_node(step.peer)
        if role != "worker":
            continue
        if step.op == "recv":
            ok = isinstance(rep, RecvReport) and rep.received_bytes > 0
            why = f"nothing from it ({getattr(rep, 'regime', type(rep).__name__)})"
            if _gone(rep):  # its connection closed (TCP): gone, not late
                gone.add(rank)
                why = "its connection closed" if not isinstance(rep, BaseException) else \
                    f"its connection closed ({type(rep).__name__}: {rep})"
        else:
            if isinstance(rep, ExecutorError):
                continue  # skipped (its receive was cut off, or nothing to send): says nothing about the peer
            ok = not isinstance(rep, BaseException)
            why = f"a send to it failed ({type(rep).__name__}: {rep})"
            if isinstance(rep, PeerGone):
                gone.add(rank)
            if ok and not sends_prove:
                continue  # neutral: the round's receives from it (if any) decide
        oks[rank] = oks.get(rank, False) or ok
        if not ok:
            whys.setdefault(rank, why)
    fresh = []
    for rank, ok in oks.items():
        why = whys.get(rank) if rank in gone else f"{whys.get(rank)}, {v.suspicion.max_missed} rounds in a row"
        if v.suspicion.observe(rank, ok, why, fatal=rank in gone, gen=v.tracker.newest.gen(rank)):
            fresh.append(rank)
    return fresh


def _post_suspects(w, v: _Views, ranks) -> None:
    """Post new suspects on the board (blocking I/O)."""
    for rank in ranks:
        v.board.suspect(rank, w.node, v.suspicion.suspects[rank], gen=v.suspicion.gen_of(rank))
        print(f"[w{w.cfg.rank}] suspects worker {rank} is dead: {v.suspicion.suspects[rank]}", flush=True)
