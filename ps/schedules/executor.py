"""The executor: runs one node's round program over a ``Transport``.

Theory of operation
-------------------
The executor is the only code that moves PS/worker messages.  It is given a
:class:`~ltp_ps.schedules.program.Program`, the node's :class:`Slots`
(named byte buffers and partial aggregates) and a handler object for the
role-specific maths, and runs the program's stages in order; the steps of a
stage run concurrently:

* Sends: reliable non-partial Sends of one slot and tag to several peers
  become one ``Transport.broadcast``; every other Send is one
  ``Transport.send``.  A ``"partial"`` payload is encoded from the slot's
  partial over ``[lo, hi)`` (:mod:`.partial` wire format) with its header and
  deficit table critical, plus the step's critical element ranges.
* *Detached sends* (*choice*): a ``"partial"`` Send its planner marked
  ``detach`` (ring and RSGCM; tree, Hoplite and MLfabric hops are left as they
  were), in no send group and not in a leading send-only stage (whose head
  start times its sends), is encoded
  when its stage starts, into a buffer of its own, and its transfer then runs
  beside the later stages; ``run`` waits for all of them before it returns, so
  its reports are complete.  The next stage waits for the stage's receives
  only.  A reliable transport's send ends when the receiver has acknowledged
  the last byte, a full round trip, where TCP's ends once the kernel holds the
  bytes; a ring step that waited for its send took about 2.3 one-way delays
  instead of one (4 workers behind a 200 ms one-way delay: 2.8 s a round over
  LTP against TCP's 1.2 s).  A later send of the same ``(peer, lo, hi)`` while
  the earlier one is still in flight (the ring's all-gather resends its
  reduce-scatter's chunks) is encoded into a second buffer: a ring holds at
  most two encodings of a chunk.
* Recvs: Recvs sharing a ``group`` are one receive group: a tolerant group is
  one ``Transport.gather`` (one Early Close deadline), a reliable group
  parallel receives under one timeout (``gather_by_recv``).  ``only_if``
  restricts a group to the peers that delivered in an earlier group (the
  READY handshake); its timeout counts from the start of that earlier group,
  so the two together never wait longer than one bound.  A peer that delivers
  nothing yields a ``missing_report`` (never an exception), so a dead peer
  costs at most the bound.  A role may bound a reliable group's stragglers
  (``handlers.straggler_bound``): once a member's message has arrived (or the
  role already holds one that dates the round), the rest get that many
  seconds more; a member cut off there is abandoned for the rest of the
  program (its receive reports ``cancelled``, later sends to it are skipped),
  so one stalled sender of several costs the round a bounded wait, not the
  group's whole timeout.  Received partials are decoded with the
  transport's bubbles (lost elements count as not delivered for all their
  contributors).
* ``Combine`` merges partials natively; ``Compute``, ``Apply``, ``Adopt`` and
  any ``Combine`` over non-partial slots call the role's handler
  (``handlers.compute(step, slots)`` etc.).  A handler returning
  :data:`STOP` ends the program early (the PS said STOP).

Results come back as :class:`RunResult`: one report (``RecvReport``,
``SendReport`` or the exception) per transfer step, in program order, and the
wall time of each receive group.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Callable, Mapping

import numpy as np

from ..aggregate import bubbles_to_elements, limit_ranges, merge_ranges
from ..errors import PeerGone
from ..transport.base import (CANCELLED, TIMEOUT, RecvReport, Transport, as_bytes_view,
                              missing_report)
from .partial import (ELEM, PARTIAL_HEADER_BYTES, Partial, PartialDecodeError, assemble, message_capacity)
from .program import RELIABLE, Program

STOP = "stop"
MIN_TIMEOUT_S = 0.001  # seconds; a dependent group never gets less
DEFAULT_TIMEOUT_S = 60.0  # seconds for a step that names none and no default was configured
IN_ORDER_WINDOW = 2  # messages in flight per peer for the payloads a role sends in order (Executor.in_order_payloads)
MAX_CRITICAL_RANGES = 128  # LTP fits at most 160 critical ranges in a registration
HINTED_PAYLOADS = frozenset({"grad", "params"})  # whole-slot receives Executor.expect hints (model-sized)


class ExecutorError(RuntimeError):
    """A program the executor cannot run (a slot or address it was not given)."""


class MissingInput(ExecutorError):
    """A send whose partial never arrived (an earlier receive came back empty); reported, not raised."""


class PartialSet:
    """The partials of one slot, keyed by element range ``(lo, hi)``.

    ``get(lo, hi)`` returns the exact range if held, else a slice of a
    partial covering it (so a worker's whole-gradient partial serves every
    chunk), else None.
    """

    def __init__(self):
        self.parts: dict = {}

    def put(self, p: Partial) -> None:
        self.parts[(p.lo, p.hi)] = p

    def get(self, lo: int, hi: int) -> Partial | None:
        p = self.parts.get((lo, hi))
        if p is not None:
            return p
        for (a, b), q in self.parts.items():
            if a <= lo and hi <= b:
                return q.slice(lo, hi)
        return None

    def clear(self) -> None:
        self.parts.clear()


class Slots:
    """A node's named data: byte buffers (``bind``) and partial aggregates (``partials``)."""

    def __init__(self):
        self.buffers: dict[str, Any] = {}
        self.critical: dict[str, Any] = {}  # slot -> byte ranges (raw payloads whose role computed them)
        self.reports: dict[str, Any] = {}  # slot -> the RecvReport of the last receive into it (roles decode raw slots)
        #: called as ``on_report(slot, report)`` the moment each receive into a slot ends, before the rest of its
        #: stage (Hoplite's workers forward a parameter chunk as soon as it is held: cut-through)
        self.on_report = None
        self._partials: dict[str, PartialSet] = {}

    def bind(self, name: str, buf) -> None:
        """Byte buffer for ``name`` (sent as is; received into)."""
        self.buffers[name] = buf

    def bind_critical(self, name: str, byte_ranges) -> None:
        """Critical byte ranges of the raw message in slot ``name`` (overrides the step's element ranges)."""
        self.critical[name] = tuple(byte_ranges)

    def buffer(self, name: str):
        try:
            return self.buffers[name]
        except KeyError:
            raise ExecutorError(f"the program uses slot {name!r} but no buffer is bound to it; "
                                f"bind it with Slots.bind before running") from None

    def partials(self, name: str) -> PartialSet:
        ps = self._partials.get(name)
        if ps is None:
            ps = self._partials[name] = PartialSet()
        return ps

    def put_partial(self, name: str, p: Partial) -> None:
        self.partials(name).put(p)

    def partial(self, name: str, lo: int, hi: int) -> Partial | None:
        ps = self._partials.get(name)
        return None if ps is None else ps.get(lo, hi)

    def assembled(self, name: str, lo: int, hi: int) -> Partial | None:
        """The partial of ``[lo, hi)`` in ``name``: one covering it, else one built from the pieces held inside
        it (a reduce in pieces; elements of no piece count 0), else None."""
        p = self.partial(name, lo, hi)
        if p is not None:
            return p
        ps = self._partials.get(name)
        parts = {r: q for r, q in (ps.parts.items() if ps else ()) if lo <= r[0] and r[1] <= hi}
        return assemble(parts, lo, hi - lo) if parts else None

    def clear_partials(self) -> None:
        self._partials.clear()

    def note_report(self, name: str, report) -> None:
        """The receive into slot ``name`` ended with ``report`` (kept in :attr:`reports`; :attr:`on_report` told)."""
        self.reports[name] = report
        if self.on_report is not None:
            self.on_report(name, report)


@dataclasses.dataclass
class RunResult:
    reports: list  # per step of program.steps(): report / exception / None (non-transfer steps)
    group_s: dict  # receive group -> seconds it took
    stopped: bool = False  # a handler returned STOP
    missing: list = dataclasses.field(default_factory=list)  # (step index, reason) of recvs that delivered nothing

    def report(self, index: int):
        return self.reports[index]


class Executor:
    """Runs programs for node ``me`` over ``transport``; ``addresses`` maps node ids to ``(host, port)``."""

    def __init__(self, transport: Transport, me: str, addresses: Mapping, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 payload_timeouts: Mapping | None = None, max_critical_ranges: int = MAX_CRITICAL_RANGES):
        self.transport = transport
        self.me = me
        self.addresses = dict(addresses)
        #: payloads whose single sends of one stage go to each peer in program order, ``IN_ORDER_WINDOW`` at a
        #: time, so they also *complete* in order (concurrent messages to one peer share the path and all end
        #: together); Hoplite's chunked parameters, which the receiver relays chunk by chunk (cut-through)
        self.in_order_payloads: frozenset = frozenset()
        #: a peer that sent nothing for a whole receive timeout is skipped by the rest of that run(), as for
        #: ``exclude`` (its later receives report missing at once): a program whose every later stage waits on
        #: the same dead neighbour (a ring) then fails after one timeout, not one per stage.  Off by default:
        #: roles with their own straggler rules (the PS, trees, Hoplite) decide about a late peer themselves
        self.skip_silent = False
        self.timeout_s = timeout_s
        self.payload_timeouts = dict(payload_timeouts or {})
        self.max_critical_ranges = max_critical_ranges
        self._scratch: dict = {}
        self._exclude: set = set()
        self._group_timeouts: dict = {}
        self._pending: dict = {}  # node -> its reliable receives now waiting (tasks: abandon() ends them)
        self._handlers = None
        self.resolve: Callable[[str], tuple | None] | None = None  # looks up a node missing from ``addresses``
        self.counters = {"sent": 0, "received": 0, "missing": 0, "undecodable": 0, "stragglers_cut": 0,
                         "hints_refused": 0}
        #: why the first receive of the latest :meth:`run` that came back empty did (:func:`describe_missing`),
        #: None while every receive so far delivered: what a role's "never arrived" error names
        self.first_missing: str | None = None

    # -- helpers -------------------------------------------------------------
    def addr(self, node: str) -> tuple:
        try:
            return tuple(self.addresses[node])
        except KeyError:
            a = self.refresh_address(node)
            if a is not None:
                return a
            raise ExecutorError(f"{self.me}: no address for {node}; pass it in the executor's address book "
                                f"(the rendezvous publishes every node's address)") from None

    def refresh_address(self, node: str) -> tuple | None:
        """Look ``node`` up again through ``resolve`` (a restarted process listens elsewhere) and keep the answer;
        None, and the book unchanged, where ``resolve`` is unset or cannot place it."""
        a = self.resolve(node) if self.resolve is not None else None
        if a is None:
            return None
        self.addresses[node] = tuple(a)
        return tuple(a)

    def _timeout(self, step) -> float:
        if step.timeout_s is not None:
            return step.timeout_s
        return self.payload_timeouts.get(step.payload, self.timeout_s)

    def _scratch_buf(self, key, nbytes: int) -> np.ndarray:
        b = self._scratch.get(key)
        if b is None or b.nbytes < nbytes:
            b = self._scratch[key] = np.zeros(nbytes, dtype=np.uint8)
        return b

    def _encode_partial(self, step, slots: Slots, iteration: int, *, copy=None) -> tuple:
        p = slots.partial(step.slot, step.lo, step.hi)
        if p is None:
            raise MissingInput(f"{self.me}: slot {step.slot!r} holds no partial over [{step.lo}, {step.hi}) "
                               f"(an earlier receive delivered nothing, or the program sends before producing it)")
        from ..wire import KIND_PARTIAL
        from .program import parse_node

        role, idx = parse_node(self.me)
        buf = self._scratch_buf(("send", step.peer, step.lo, step.hi, copy), message_capacity(step.hi - step.lo))
        view = p.encode_into(buf, kind=KIND_PARTIAL, origin=idx if role == "worker" else -1, iteration=iteration)
        n_runs = (view.nbytes - PARTIAL_HEADER_BYTES - ELEM * p.n) // 24
        crit = list(Partial.critical_bytes(p.n, n_runs))
        for a, b in step.critical:
            a, b = max(a, step.lo), min(b, step.hi)
            if b > a:
                crit.append((PARTIAL_HEADER_BYTES + ELEM * (a - step.lo), PARTIAL_HEADER_BYTES + ELEM * (b - step.lo)))
        return view, limit_ranges(crit, self.max_critical_ranges)

    @property
    def excluded(self) -> frozenset:
        """Peers the running program skips: its ``exclude`` plus those abandoned or found gone since."""
        return frozenset(self._exclude)

    def abandon(self, nodes) -> None:
        """Stop waiting for ``nodes`` (declared dead while a program runs): their pending reliable receives end
        at once as missing (``cancelled``) and later steps with them are skipped, as for ``exclude``.  Tolerant
        receive groups end at their own deadline (one transport gather cannot drop one member)."""
        for n in nodes:
            self._exclude.add(n)
            for t in list(self._pending.get(n, ())):
                t.cancel()

    # -- running ---------------------------------------------------------------
    async def expect(self, program: Program, slots: Slots, *, exclude=()) -> int:
        """Tell the transport where ``program``'s tagged, whole-slot receives will land
        (``Transport.expect``), before a run that is not ready to post them: a message that arrives early is
        then written in place, not copied from a transport buffer when its receive is posted.  From here until
        those receives complete, the slots' buffers belong to the transport.  Only model-sized payloads
        (:data:`HINTED_PAYLOADS`) are hinted: partials go to scratch buffers chosen at run time, and notes are a
        few bytes.  A hint is only an optimisation: one that cannot be given (a peer with no usable address)
        is counted (``counters["hints_refused"]``) and skipped, and the run then meets that peer's fault where it
        always did.  Returns the number of hints given."""
        n = 0
        for s in program.recvs():
            if s.payload not in HINTED_PAYLOADS or s.tag is None or s.peer in exclude:
                continue
            try:
                await self.transport.expect(self.addr(s.peer), slots.buffer(s.slot), tag=s.tag)
            except Exception:  # noqa: BLE001  (never fail a round over a hint)
                self.counters["hints_refused"] += 1
                continue
            n += 1
        return n

    async def run(self, program: Program, slots: Slots, handlers: Any = None, *, iteration: int = 0,
                  exclude=(), group_timeouts: Mapping | None = None, head_start_s: float | None = None) -> RunResult:
        """Run ``program``'s stages in order; returns every transfer's report.

        ``exclude``: peers known dead (their receives report missing at once,
        sends to them are skipped); ``group_timeouts``: seconds per receive
        group, overriding the steps' own (bounds the role computes at run time).
        ``head_start_s``: the program's leading send-only stages are an order of
        preference (a tree's farthest subtree first): each gets this long to
        finish before the next one starts beside it, and the first stage with
        anything else waits for all of them.
        """
        steps = program.steps()
        res = RunResult(reports=[None] * len(steps), group_s={})
        self.first_missing = None
        self._exclude = set(exclude)
        self._group_timeouts = dict(group_timeouts or {})
        self._handlers = handlers
        group_t0: dict = {}
        group_ok: dict = {}
        i0 = 0
        ahead: list = []  # leading send-only stages still running beside later ones
        leading = head_start_s is not None
        detached: dict = {}  # (peer, lo, hi, copy) -> this run's detached send reading that scratch buffer
        try:
            for k, stage in enumerate(program.stages):
                idx = list(range(i0, i0 + len(stage)))
                i0 += len(stage)
                leading = leading and all(s.op in ("send", "forward") for s in stage)
                if leading:  # send-only: nothing here can STOP the program
                    ahead.append(asyncio.ensure_future(  # its sends end within it: its head start times them
                        self._run_stage(stage, idx, slots, handlers, res, group_t0, group_ok, iteration)))
                    if k + 1 < len(program.stages):
                        await asyncio.wait({ahead[-1]}, timeout=head_start_s)
                    else:  # the program is all sends: it ends when every one has
                        await asyncio.gather(*ahead)
                        ahead = []
                    continue
                if ahead:
                    await asyncio.gather(*ahead)
                    ahead = []
                stop = await self._run_stage(stage, idx, slots, handlers, res, group_t0, group_ok, iteration,
                                             detached=detached)
                if stop:
                    res.stopped = True
                    break
            await asyncio.gather(*detached.values())  # their reports are part of the result
        finally:
            for t in ahead:
                t.cancel()
            for t in detached.values():
                t.cancel()  # only where run() itself failed or was cancelled: done tasks ignore it
        return res

    async def _run_stage(self, stage, idx, slots, handlers, res, group_t0, group_ok, iteration, *,
                         detached: dict | None = None) -> bool:
        # Local steps first in program order if the stage has no transfers; mixed stages run transfers then local.
        transfers = [(i, s) for i, s in zip(idx, stage) if s.op in ("send", "forward", "recv")]
        local = [(i, s) for i, s in zip(idx, stage) if s.op not in ("send", "forward", "recv")]
        prepare = getattr(handlers, "prepare_transfer", None) if handlers is not None else None
        if prepare is not None:
            # the role's last word on a transfer once the stages before it ran (a bound read from a message that
            # arrived, a relay of a copy that did not arrive whole): the step it returns runs instead (None: as is)
            transfers = [(i, prepare(s, slots) or s) for i, s in transfers]
        if transfers:
            await self._transfers(transfers, slots, res, group_t0, group_ok, iteration, detached=detached)
        for i, s in local:
            if await self._local(s, slots, handlers) == STOP:
                return True
        return False

    async def _local(self, step, slots: Slots, handlers):
        if step.op == "combine":
            src = slots._partials.get(step.src)
            if src is not None or handlers is None or not hasattr(handlers, "combine"):
                p = slots.partial(step.src, step.lo, step.hi)
                if p is None:
                    return None  # nothing arrived: the accumulator keeps what it has
                acc = slots.partial(step.dst, step.lo, step.hi)
                if acc is None:
                    slots.put_partial(step.dst, p.copy())
                else:
                    acc = acc.copy() if (acc.lo, acc.hi) != (step.lo, step.hi) else acc
                    acc.merge(p)
                    slots.put_partial(step.dst, acc)
                return None
        fn = getattr(handlers, step.op, None) if handlers is not None else None
        if fn is None:
            raise ExecutorError(f"{self.me}: the program has a {step.op!r} step but the role gave no handler for it")
        out = fn(step, slots)
        if asyncio.iscoroutine(out):
            out = await out
        return out

    async def _transfers(self, transfers, slots, res, group_t0, group_ok, iteration, *,
                         detached: dict | None = None) -> None:
        """Run a stage's transfers; ``detached``: the run's detached sends, where this stage may add to them
        (None: a leading send-only stage, whose sends end within it)."""
        loop = asyncio.get_running_loop()
        jobs = []
        # Sends: broadcast groups (reliable, same slot+tag, raw payload) and single sends.
        bcast: dict = {}
        for i, s in transfers:
            if s.op in ("send", "forward") and s.mode == RELIABLE and s.payload != "partial":
                bcast.setdefault((s.slot, s.tag, s.payload, self._timeout(s)), []).append((i, s))  # one bound each
        in_bcast = {i for v in bcast.values() if len(v) > 1 for i, _ in v}
        for key, members in bcast.items():
            if len(members) > 1:
                jobs.append(self._broadcast(members, slots, res))
        ordered: dict = {}
        for i, s in transfers:
            if s.op in ("send", "forward") and i not in in_bcast:
                if s.payload in self.in_order_payloads:
                    ordered.setdefault(s.peer, []).append((i, s))
                elif detached is not None and self._detachable(s):
                    copy = 0  # the first of this chunk's scratch buffers no send in flight reads
                    while (t := detached.get((s.peer, s.lo, s.hi, copy))) is not None and not t.done():
                        copy += 1
                    # encoded now, while the slot holds what this stage sends
                    prepared = self._prepare_send(i, s, slots, res, iteration, copy=copy)
                    if prepared is not None:
                        detached[(s.peer, s.lo, s.hi, copy)] = asyncio.ensure_future(
                            self._transmit(i, s, *prepared, res))
                else:
                    jobs.append(self._send(i, s, slots, res, iteration))
        for members in ordered.values():
            jobs.append(self._send_in_order(members, slots, res, iteration))
        send_groups = {}
        for i, s in transfers:
            if s.op in ("send", "forward") and getattr(s, "group", None) is not None:
                send_groups.setdefault(s.group, []).append((i, s))
        # Receives: by group (None = each on its own).
        groups: dict = {}
        for i, s in transfers:
            if s.op == "recv":
                groups.setdefault(s.group if s.group is not None else ("_", i), []).append((i, s))
        now = loop.time()
        for g, members in groups.items():
            if isinstance(g, str):
                group_t0[g] = now
            jobs.append(self._recv_group(g, members, slots, res, group_t0, group_ok))
        await asyncio.gather(*jobs)
        for g, members in send_groups.items():  # a send group named in several stages: every peer it reached
            group_ok[g] = group_ok.get(g, set()) | {
                s.peer for i, s in members if res.reports[i] is not None and not isinstance(res.reports[i], BaseException)}

    async def _broadcast(self, members, slots, res) -> None:
        skip = [(i, s) for i, s in members if s.peer in self._exclude]
        for i, s in skip:
            res.reports[i] = ExecutorError(f"{s.peer} is excluded (known dead)")
        members = [(i, s) for i, s in members if s.peer not in self._exclude]
        if not members:
            return
        s0 = members[0][1]
        data = slots.buffer(s0.slot)
        peers = [self.addr(s.peer) for _, s in members]
        try:
            reps = await self.transport.broadcast(peers, data, tag=s0.tag, timeout=self._timeout(s0))
        except Exception as exc:  # a transport that raises instead of reporting per peer
            reps = [exc] * len(members)
        for (i, s), r in zip(members, reps):
            res.reports[i] = r
            self._note_gone(s.peer, r)
        self.counters["sent"] += len(members)

    def _note_gone(self, node: str, report) -> None:
        """A send that found its peer gone (unreachable, connection closed) ends the program's business with it:
        its later receives do not wait (the PS's partial gather skips a child whose parameters bounced)."""
        if isinstance(report, PeerGone):
            self.abandon([node])
            self.refresh_address(node)  # it may be back as a new process elsewhere: the next send goes there

    async def _send_in_order(self, members, slots, res, iteration) -> None:
        window = asyncio.Semaphore(IN_ORDER_WINDOW)  # FIFO: the sends take it in program order

        async def one(i, s):
            async with window:
                await self._send(i, s, slots, res, iteration)

        await asyncio.gather(*(one(i, s) for i, s in members))

    @staticmethod
    def _detachable(s) -> bool:
        """Whether send step ``s`` may finish beside later stages (module comment, *Detached sends*): its planner
        marked it (``Send.detach``), and it is a partial, encoded into a buffer of its own, in no send group
        (whose reach a later stage reads)."""
        return getattr(s, "detach", False) and s.payload == "partial" and getattr(s, "group", None) is None

    async def _send(self, i, s, slots, res, iteration) -> None:
        """One send step; its report (or the exception) goes to ``res.reports[i]``."""
        prepared = self._prepare_send(i, s, slots, res, iteration)
        if prepared is not None:
            await self._transmit(i, s, *prepared, res)

    def _prepare_send(self, i, s, slots, res, iteration, *, copy=None) -> tuple | None:
        """``(data, critical)`` of send step ``s``, read from its slot now; None (reported in ``res``) where the
        peer is excluded or the partial to send is missing.  ``copy``: which of the chunk's scratch buffers a
        detached send encodes into (None: the one of sends that end within their stage)."""
        if s.peer in self._exclude:
            res.reports[i] = ExecutorError(f"{s.peer} is excluded (known dead)")
            return None
        if s.payload == "partial":
            try:
                return self._encode_partial(s, slots, iteration, copy=copy)
            except MissingInput as exc:
                res.reports[i] = exc
                res.missing.append((i, str(exc)))
                return None
        data = slots.buffer(s.slot)
        last = slots.reports.get(s.slot)
        if s.op == "forward" and isinstance(last, RecvReport) and last.total_bytes:
            data = as_bytes_view(data)[:last.total_bytes]  # relay what arrived, not the whole buffer
        critical = slots.critical.get(s.slot)
        if critical is None:
            # only a tolerant raw gradient has a 64-byte header to protect; notes, STOP, grants and reliable
            # messages carry no ranges (LTP refuses a range outside a short buffer)
            critical = (_raw_critical(getattr(s, "critical", ()), s.lo, self.max_critical_ranges)
                        if s.payload == "grad" and s.mode != RELIABLE else ())
        return data, critical

    async def _transmit(self, i, s, data, critical, res) -> None:
        try:
            res.reports[i] = await self.transport.send(self.addr(s.peer), data, reliable=s.mode == RELIABLE,
                                                       critical=critical, element_size=ELEM, tag=s.tag,
                                                       timeout=self._timeout(s))
            self.counters["sent"] += 1
        except Exception as exc:  # reported, not raised: the role decides (drop the peer, fail the round)
            res.reports[i] = exc
            self._note_gone(s.peer, exc)

    async def _recv_group(self, g, members, slots, res, group_t0, group_ok) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        s0 = members[0][1]
        timeout = self._group_timeouts.get(g, self._timeout(s0)) if isinstance(g, str) else self._timeout(s0)
        if s0.only_if is not None:
            ok = group_ok.get(s0.only_if)  # None: that group ran in an earlier run() call (the role filtered)
            start = group_t0.get(s0.only_if, t0)  # only receive groups have a start: sends do not eat the bound
            timeout = max(MIN_TIMEOUT_S, timeout - (t0 - start))
        else:
            ok = None
        bufs = [self._recv_buf(i, s, slots) for i, s in members]
        live = [k for k, (i, s) in enumerate(members)
                if (ok is None or s.peer in ok) and s.peer not in self._exclude]
        skipped = {}  # step index -> why its receive was never posted (its ``res.missing`` reason)
        for k, (i, s) in enumerate(members):
            if k not in live:
                res.reports[i] = missing_report(self.addr(s.peer), s.tag, as_bytes_view(bufs[k]).nbytes, TIMEOUT, 0.0)
                skipped[i] = ("not waited for: excluded (known dead or abandoned)" if s.peer in self._exclude else
                              f"not waited for: its exchange in group {s0.only_if!r} did not succeed")
        if live:
            peers = [self.addr(members[k][1].peer) for k in live]
            lbufs = [bufs[k] for k in live]
            tags = {members[k][1].tag for k in live}
            if isinstance(g, str) and s0.mode != RELIABLE and len(tags) == 1 and None not in tags:
                reps = await self.transport.gather(peers, lbufs, tag=s0.tag, timeout=timeout, clock=s0.clock)
            else:  # one receive per peer, each abandonable, one deadline (``gather_by_recv``'s semantics)
                reps = await self._recv_reliable([members[k][1] for k in live], peers, lbufs, timeout, slots)
            for k, r in zip(live, reps):
                res.reports[members[k][0]] = r
                if self.first_missing is None and (not isinstance(r, RecvReport) or r.received_bytes == 0):
                    self.first_missing = describe_missing(members[k][1].peer, r)
                if (self.skip_silent and isinstance(r, RecvReport) and r.received_bytes == 0
                        and r.regime == TIMEOUT):
                    self._exclude.add(members[k][1].peer)
        if isinstance(g, str):
            res.group_s[g] = loop.time() - t0
            group_ok[g] = {s.peer for i, s in members
                           if isinstance(res.reports[i], RecvReport) and res.reports[i].received_bytes > 0}
        for k, (i, s) in enumerate(members):
            r = res.reports[i]
            slots.note_report(s.slot, r)
            if not isinstance(r, RecvReport) or r.received_bytes == 0:
                self.counters["missing"] += 1
                res.missing.append((i, skipped.get(i) or getattr(r, "regime", repr(r))))
                continue
            self.counters["received"] += 1
            if s.payload == "partial":
                try:
                    p = Partial.decode(bufs[k], r.bubbles if r.critical_complete else [(0, r.total_bytes)])
                except PartialDecodeError as exc:
                    self._undecodable(res, i, f"the partial from {s.peer} did not decode: {exc}")
                    continue
                if (p.lo, p.hi) != (s.lo, s.hi):
                    self._undecodable(res, i, f"the partial from {s.peer} covers [{p.lo}, {p.hi}), "
                                              f"expected [{s.lo}, {s.hi})")
                    continue
                slots.put_partial(s.slot, p)

    def _undecodable(self, res, i: int, why: str) -> None:
        self.counters["undecodable"] += 1
        res.missing.append((i, why))
        if self.first_missing is None:
            self.first_missing = why

    async def _recv_reliable(self, steps, peers, bufs, timeout, slots) -> list:
        """Parallel reliable receives under one ``timeout``; with the role's ``straggler_bound(steps, slots,
        arrived)`` (seconds, or None for no bound), the members still waiting that long after a message of the
        group arrived (``arrived``: its buffer), or after the group started when the role already holds one
        (``arrived`` None), are cut off: abandoned for the rest of the program."""
        tasks = [asyncio.ensure_future(self._recv_abandonable(s, p, b, timeout)) for s, p, b in zip(steps, peers, bufs)]
        bound = getattr(self._handlers, "straggler_bound", None)
        if bound is None:
            return list(await asyncio.gather(*tasks))
        loop = asyncio.get_running_loop()
        b = bound(steps, slots, None)
        t_end = None if b is None else loop.time() + b
        pending = set(tasks)
        try:
            while pending:
                wait_s = None if t_end is None else max(0.0, t_end - loop.time())
                done, pending = await asyncio.wait(pending, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    break  # the bound passed
                for t in done:
                    r = t.result()
                    if isinstance(r, RecvReport) and r.received_bytes > 0:
                        b = bound(steps, slots, bufs[tasks.index(t)])
                        if b is not None:
                            t_end = min(t_end if t_end is not None else float("inf"), loop.time() + b)
            if pending:
                cut = [s.peer for s, t in zip(steps, tasks) if t in pending]
                self.counters["stragglers_cut"] += len(cut)
                self.abandon(cut)
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()

    def _recv_buf(self, i, s, slots):
        if s.payload == "partial":
            return self._scratch_buf(("recv", s.peer, s.lo, s.hi), message_capacity(s.hi - s.lo))
        return slots.buffer(s.slot)

    async def _recv_abandonable(self, s, peer, buf, timeout) -> RecvReport:
        """``_recv_one`` that :meth:`abandon` can end early (a missing report, regime ``cancelled``)."""
        t0 = time.monotonic()
        task = asyncio.ensure_future(self._recv_one(peer, buf, s, timeout))
        waiting = self._pending.setdefault(s.peer, set())
        waiting.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if task.cancelled() and not (me is not None and me.cancelling()):
                return missing_report(peer, s.tag or 0, as_bytes_view(buf).nbytes, CANCELLED, time.monotonic() - t0)
            raise  # the caller itself was cancelled
        finally:
            waiting.discard(task)
            if not task.done():
                task.cancel()

    async def _recv_one(self, peer, buf, s, timeout) -> RecvReport:
        t0 = time.monotonic()
        try:
            return await self.transport.recv(buf, peer=peer, tag=s.tag, timeout=timeout)
        except (TimeoutError, asyncio.TimeoutError):
            return missing_report(peer, s.tag or 0, as_bytes_view(buf).nbytes, TIMEOUT, time.monotonic() - t0)
        except (ConnectionError, OSError):
            return missing_report(peer, s.tag or 0, as_bytes_view(buf).nbytes, CANCELLED, time.monotonic() - t0,
                                  peer_gone=True)


def describe_missing(node: str, report) -> str:
    """Why nothing arrived from ``node``, from its receive's ``report`` (or exception), in words for an error:
    gone (its connection closed or it is unreachable: the process died) told apart from silent for the whole
    receive timeout (died, stalled or cut off: nothing here can say which) and from abandoned."""
    if not isinstance(report, RecvReport):
        return f"the receive from {node} failed: {report!r}"
    took = report.duration_s
    if report.peer_gone:
        return f"{node} is gone: its connection closed after {took:.2f} s (the process exited or was killed)"
    if report.regime == TIMEOUT:
        return f"{node} sent nothing for {took:.1f} s, the whole receive timeout (it died, stalled or was cut off)"
    if report.regime == CANCELLED:
        return f"the receive from {node} was abandoned after {took:.2f} s (the peer was given up on)"
    return f"nothing arrived from {node} (regime {report.regime!r} after {took:.2f} s)"


def _raw_critical(elements, lo: int, max_ranges: int) -> list:
    """A raw gradient message's critical bytes: its 64-byte header plus the given element ranges."""
    from ..wire import HEADER_BYTES

    out = [(0, HEADER_BYTES)]
    for a, b in elements:
        out.append((HEADER_BYTES + ELEM * (a - lo), HEADER_BYTES + ELEM * (b - lo)))
    return limit_ranges(out, max_ranges)


def lost_elements(report: RecvReport, *, offset: int, n_elems: int) -> list:
    """Element ranges of a raw gradient message that did not arrive (helper for roles)."""
    if report.received_bytes == 0:
        return [(0, n_elems)]
    return merge_ranges(bubbles_to_elements(report.bubbles, offset=offset, n_elems=n_elems))
