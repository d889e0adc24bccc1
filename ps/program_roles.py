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
  partials the broadcast bound plus the gather bound (they wait for the
  parameters to go down the tree, the compute, and the partials to come up).
* Worker ``w`` (:func:`worker_run`): each round binds every raw ``params``
  slot of its program to its receive buffer for the shard whose range the
  step names, runs the program; ``Compute`` reads the parameter messages (a
  STOP ends the run after it has been forwarded down the tree), computes the
  gradient and stores it as a partial.  Forwarded parameter messages are sent
  at their received length.

Workers need each other's addresses (a tree's edges join workers); the CLI
publishes them through the store (``schedule_cli``).  Round numbers: workers
count rounds from the PS's first round (0, or the resumed iteration given
as ``start``); a worker joining mid-run is not supported by tree schedules.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from .errors import RemoteError, TransportTimeout
from .membership import State
from .schedules.executor import STOP
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
    members = ps.membership.active()
    ps.transport.discard_before(tag_of(it, 0))
    msg = ps._params_message(KIND_PARAMS, {})
    ps._address(members)
    ps._slots.bind("params", msg)
    ps._slots.clear_partials()
    prog = ps.planner.plan(it).program(ps.node)
    bt = ps.deadline.broadcast_timeout(len(msg), len(members))
    bound = bt + ps.deadline.timeout(len(msg), len(members))
    ps.executor.payload_timeouts.update(params=bt, partial=bound)
    dead = {worker_node(r) for r, m in ps.membership.members.items() if m.state is not State.ACTIVE}
    h = _ServerHandlers(ps, it)
    t0 = time.monotonic()
    res = await ps.executor.run(prog, ps._slots, h, iteration=it, exclude=dead)
    wall = time.monotonic() - t0
    _observe_children(ps, it, prog, res, dead, wall, bound)
    p = h.partial
    contributors = p.contributors if p is not None else 0
    loss = p.loss_sum / contributors if contributors else float("nan")
    frac = float(p.counts().mean()) / max(1, len(members)) if p is not None and p.n else 0.0
    ps.iteration += 1
    row = {"event": "iteration", "t": time.time(), "shard": ps.shard, "iteration": it, "epoch": it // ps.ipe,
           "workers": len(members), "contributors": contributors, "gather_s": wall, "gather_wait_s": wall,
           "broadcast_s": 0.0, "round_s": wall, "delivered": {"all": frac}, "regime": {}, "bubbles": {},
           "lost_elements": {}, "missing_steps": len(res.missing), "loss": loss,
           "samples": p.samples if p is not None else 0, "schedule": ps.planner.name}
    ps._write_member_events(it)
    ps.metrics.write(row)
    ps._check_health(it, [loss] if contributors else [], h.applied, len(ps.membership.active()), bound)
    return row


def _observe_children(ps, it: int, prog: Program, res, dead: set, wall: float, bound: float) -> None:
    """Membership from the PS's own transfers with its tree children (as the direct PS does per worker)."""
    seen: dict = {}  # rank -> delivered a partial this round (True) / failed (reason)
    for step, rep in zip(prog.steps(), res.reports):
        if step.op not in ("send", "recv") or step.peer in dead:
            continue
        role, rank = parse_node(step.peer)
        if role != "worker":
            continue
        if step.op == "send" and isinstance(rep, BaseException):
            why = f"parameters of round {it} failed after {wall:.2f} s: {type(rep).__name__}: {rep}"
            ps.membership.failed(rank, why)
            ps.log(f"[ps{ps.shard}] dropped worker {rank}: {why}")
        elif step.op == "recv" and step.payload == "partial":
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
    """STOP down the schedule's parameter path (the leading send-only stages of the next round's program)."""
    members = ps.membership.active()
    ps._address(ps.membership.members.values())
    ps._slots.bind("params", ps._params_message(KIND_STOP, {}))
    prog = _send_only_prefix(ps.planner.plan(ps.iteration).program(ps.node))
    prog = Program(prog.node, tuple(tuple(_with_timeout(s, timeout) for s in st) for st in prog.stages))
    live = {worker_node(m.rank) for m in members}
    dead = {s.peer for s in prog.steps() if s.op in ("send", "forward") and s.peer not in live}
    await ps.executor.run(prog, ps._slots, iteration=ps.iteration, exclude=dead)


def _with_timeout(step, timeout):
    import dataclasses

    return dataclasses.replace(step, timeout_s=timeout) if hasattr(step, "timeout_s") else step


class _WorkerHandlers:
    def __init__(self, w, it: int):
        self.w, self.it = w, it
        self.stopped = False

    async def compute(self, step, slots):
        w = self.w
        headers, stale = [], []
        for s, buf in zip(w.shards, w._in):
            h = _fresh_header(buf, self.it)
            if h is None:
                # this shard's parameters did not come down the tree this round (a parameter hop timed
                # out: e.g. a throttled aggregator): compute on the slice held from an earlier round
                # (the initial parameters before the first), as a stale gradient, rather than fail
                stale.append(s.shard)
                continue
            if h.kind == KIND_STOP:
                self.stopped = True
                return STOP
            if h.n_elems != s.hi - s.lo:
                raise RemoteError(f"worker {w.cfg.rank}: shard {s.shard} sent round {h.iteration} with "
                                  f"{h.n_elems} parameters, expected {s.hi - s.lo}")
            w.flat[s.lo:s.hi] = buf[HEADER_BYTES:HEADER_BYTES + ELEM * h.n_elems].view(np.float32)
            headers.append(h)
        if stale:
            if len(stale) == len(w.shards):
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
        return None


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
    it = start
    while True:
        prog = w.planner.plan(it).program(w.node)
        for st in prog.steps():
            if st.op in ("recv", "forward") and st.payload == "params":
                i = next(k for k, s in enumerate(w.shards) if (s.lo, s.hi) == (st.lo, st.hi))
                w.slots.bind(st.slot, w._in[i])
        h = _WorkerHandlers(w, it)
        res = await w.executor.run(prog, w.slots, h, iteration=it)
        if h.stopped or res.stopped:
            return {"iterations": w.iterations, "last_loss": w.last_loss, "stopped": True}
        first = [r for st, r in zip(prog.steps(), res.reports) if st.op == "recv" and st.payload == "params"]
        if first and all(getattr(r, "received_bytes", 0) == 0 for r in first):
            raise TransportTimeout(f"worker {w.cfg.rank}: no parameters for round {it} within "
                                   f"{w.cfg.pull_timeout_s} s")
        w.iterations += 1
        it += 1
        if w.cfg.max_iterations is not None and w.iterations >= w.cfg.max_iterations:
            return {"iterations": w.iterations, "last_loss": w.last_loss, "stopped": False}
