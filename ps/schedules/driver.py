"""Run-time driver for dynamic schedules: feeds a :class:`Controller` events, executes its grants.

Theory of operation
-------------------
A dynamic schedule (MLfabric, Hoplite) decides steps as the run unfolds: a
sans-IO :class:`~ltp_ps.schedules.program.Controller` takes events and returns
:class:`~ltp_ps.schedules.program.Grant`\\ s.  This module is the thin asyncio
adapter between that controller and the transport.  Nothing here sends around
the :class:`~ltp_ps.schedules.executor.Executor`: every grant, event report
and grant stage is a one-stage program the executor runs.

The host (the PS for MLfabric) runs :class:`ControllerDriver`:

* ``feed(event)`` passes an event to the controller (with ``now`` from the
  driver's clock) and dispatches the grants it returns;
* grants are queued **per node** and run strictly in issue order, one stage
  each: a grant to the host itself runs on the host's executor (its receive
  reports become ``TransferDone`` events at once); a grant to another node
  waits until its ``start_at`` on the host's clock (nodes never compare
  clocks) and is then sent to that node reliably as a control message
  (``deliver`` callback);
* a timer task calls ``on_timer`` at ``next_deadline()`` and, every
  ``t_lag_s``, hands the :class:`RateMonitor`'s per-node rate estimates to
  the controller's ``update_rates`` (when it has one).

A node that is not the host runs :class:`GrantFollower` over its control
stream: receive grant ``k`` (reliable), run its stage on the node's executor,
report every receive as a ``TransferDone`` back to the host on the node's
upward control stream.

Control streams: one per direction and node pair, message ``k`` tagged
``Tag(k, PHASE_CONTROL, direction, 0, KIND_GRANT)`` so a receiver posts
exactly the next message and never confuses streams or rounds; the peer
filter of the receive separates nodes.  Messages are a 4-byte length and
UTF-8 JSON (``encode_message`` / ``decode_message``); a message that does not
decode is dropped and counted by the caller, never raised into the loop.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from typing import Any, Awaitable, Callable, Mapping

from ..errors import TransportTimeout
from ..transport.base import CANCELLED, TIMEOUT, CloseReason, RecvReport, SendReport
from ..wire import KIND_GRANT, KIND_PARAMS
from . import tags as _tags
from .executor import Executor, Slots
from .program import (RELIABLE, ChunkArrived, Grant, NodeFailed, NodeReady, Program, Recv, Send, TransferDone,
                      SLOT_GRAD)

T_LAG_S = 1.0  # seconds between rate refreshes handed to the controller (MLfabric's t_lag)
GRANTS_PER_BATCH = 32  # grants queued for one node that one ``deliver_batch`` call takes at most
CONTROL_BYTES = 1 << 16  # bytes: the largest control message (a grant of a few hundred steps)
MIN_RATE_SAMPLE_BYTES = 16384  # bytes: smaller transfers are latency-bound, their goodput says nothing of the rate
TURNED_AWAY_RESENDS = 3  # times a control message the peer's receive closed without is sent again before it fails
#                          (more while the channel's patience lasts)
RESEND_BACKOFF_S = 0.02  # seconds before the first such resend; doubling each time, at most RESEND_BACKOFF_MAX_S
RESEND_BACKOFF_MAX_S = 1.0
RATE_EWMA = 0.5  # weight of a new rate sample in the monitor's running estimate
#: a transfer of fewer bytes than this many round trips at its own BtlBw never filled its path: what it measured is
#: bounded by the bytes it had in flight per round trip (latency-bound), so the path carries at least that rate
PIPE_FILL_RTTS = 4.0
DOWN = 0  # control stream direction: host -> node (grants, stop)
UP = 1  # node -> host (ready notes, transfer reports)
PROBE = 2  # host -> node liveness probes, read and ignored (a send to a dead process fails: ``hoplite_roles``)
_LEN = struct.Struct("<I")


class ControlDecodeError(ValueError):
    """A control message that is not a length-prefixed JSON object (dropped and counted by the caller)."""


def control_tag(seq: int, direction: int, epoch: int = 0) -> int:
    """Tag of control message ``seq`` on the ``direction`` (DOWN / UP) stream of incarnation ``epoch``."""
    return _tags.pack(seq % (_tags.MAX_ITERATION + 1), _tags.PHASE_CONTROL, direction, epoch % (_tags.MAX_CHUNK + 1),
                      KIND_GRANT)


def params_tag(seq: int, epoch: int = 0) -> int:
    """Tag of the ``seq``-th parameter message the host sends one node (asynchronous pulls) in its incarnation
    ``epoch`` (a worker that joined again starts at 0; an old message still buffered is never read as new)."""
    return _tags.pack(seq % (_tags.MAX_ITERATION + 1), _tags.PHASE_PULL, 0, epoch % (_tags.MAX_CHUNK + 1), KIND_PARAMS)


def encode_message(msg: Mapping) -> bytes:
    """A control message: 4-byte little-endian length, UTF-8 JSON, spaces to a multiple of 4 bytes."""
    body = json.dumps(msg, separators=(",", ":")).encode()
    if _LEN.size + len(body) > CONTROL_BYTES:
        raise ValueError(f"control message of {len(body)} bytes exceeds CONTROL_BYTES={CONTROL_BYTES}; "
                         f"split the grant into smaller stages")
    pad = -(_LEN.size + len(body)) % 4  # transports move whole float32 elements
    return _LEN.pack(len(body)) + body + b" " * pad


def decode_message(buf, nbytes: int) -> dict:
    """The JSON object in the first ``nbytes`` of ``buf``; raises :class:`ControlDecodeError`."""
    mv = memoryview(buf).cast("B")
    if nbytes < _LEN.size or nbytes > mv.nbytes:
        raise ControlDecodeError(f"control message of {nbytes} bytes")
    (n,) = _LEN.unpack_from(mv, 0)
    if _LEN.size + n > nbytes:
        raise ControlDecodeError(f"control message says {n} bytes, {nbytes - _LEN.size} arrived")
    try:
        d = json.loads(bytes(mv[_LEN.size:_LEN.size + n]))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ControlDecodeError(f"control message is not JSON: {exc}") from None
    if not isinstance(d, dict):
        raise ControlDecodeError("control message is not a JSON object")
    return d


def event_to_json(ev) -> dict:
    """A node's event as a control message body."""
    if isinstance(ev, NodeReady):
        return {"ready": {"node": ev.node, "iteration": ev.iteration, "nbytes": ev.nbytes, "version": ev.version,
                          "norm": ev.norm}}
    if isinstance(ev, TransferDone):
        return {"done": {"src": ev.src, "dst": ev.dst, "tag": ev.tag, "ok": ev.ok, "duration_s": ev.duration_s}}
    if isinstance(ev, ChunkArrived):
        return {"chunk": {"node": ev.node, "key": ev.key, "lo": ev.lo, "hi": ev.hi, "complete": ev.complete}}
    raise ValueError(f"cannot encode event {ev!r}")


def event_from_json(d: Mapping, sender: str):
    """The event in a node's control message; raises :class:`ControlDecodeError` (also when it speaks for
    another node than ``sender``)."""
    try:
        if "ready" in d:
            r = d["ready"]
            ev = NodeReady(str(r["node"]), int(r["iteration"]), int(r["nbytes"]), int(r["version"]),
                           float(r["norm"]))
            who = ev.node
        elif "done" in d:
            r = d["done"]
            ev = TransferDone(str(r["src"]), str(r["dst"]), int(r["tag"]), bool(r["ok"]), float(r["duration_s"]))
            who = ev.dst
        elif "chunk" in d:
            r = d["chunk"]
            ev = ChunkArrived(str(r["node"]), str(r["key"]), int(r["lo"]), int(r["hi"]), bool(r["complete"]))
            who = ev.node
        else:
            raise ControlDecodeError(f"unknown control message {sorted(d)}")
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ControlDecodeError):
            raise
        raise ControlDecodeError(f"malformed event: {exc}") from None
    if who != sender:
        raise ControlDecodeError(f"{sender} reported an event of {who}")
    return ev


class RateMonitor:
    """Per-node up/down rate estimates (bytes/s) from transfer reports; sans-IO.

    ``observe(report, src=, dst=)`` takes a finished transfer: the transport's
    bottleneck-bandwidth estimate (LTP's ``btlbw_bps``) when it has one, else
    the goodput of a transfer of at least ``MIN_RATE_SAMPLE_BYTES``; the sample
    bounds ``src``'s up rate and ``dst``'s down rate (smoothed, ``RATE_EWMA``).
    A sample from a transfer that never filled its path is only a lower bound
    (a 20 kB gradient over 40 ms measures 0.5 MB/s on a 1 Gbit/s link): a BtlBw
    from a message shorter than ``PIPE_FILL_RTTS`` round trips at that rate, a
    goodput that lasted fewer round trips, or an LTP goodput with no BtlBw (its
    sender was still in STARTUP). A lower bound may raise an estimate, never
    lower one, and makes none on its own. The planner's model has no
    propagation delay (``mlfabric_links``): a latency-bound rate would charge
    every transfer its round trip as link time, and n of them serialised at the
    PS would look n round trips long.
    ``take(now)`` returns ``(up, down)`` every ``t_lag_s`` (else None).
    """

    def __init__(self, t_lag_s: float = T_LAG_S, *, now: float = 0.0):
        if t_lag_s <= 0:
            raise ValueError("t_lag_s must be > 0 seconds")
        self.t_lag_s = float(t_lag_s)
        self.up: dict = {}
        self.down: dict = {}
        self.samples = 0
        self.lower_bounds = 0  # samples that were only lower bounds (latency-bound transfers)
        self._next = now + self.t_lag_s

    @staticmethod
    def sample(report) -> tuple[float, bool] | None:
        """``(bytes/s, lower_bound)`` from one report, or None when it says nothing of the rate."""
        raw = getattr(report, "raw", None)
        nbytes = (report.received_bytes if isinstance(report, RecvReport)
                  else report.delivered_bytes if isinstance(report, SendReport) else 0)
        btlbw = float(getattr(raw, "btlbw_bps", 0.0) or 0.0)  # bytes/s, as on LTP's wire (docs/protocol.md)
        rtprop = float(getattr(raw, "rtprop_s", 0.0) or 0.0)  # 0: the transport does not say
        if btlbw > 0:
            return btlbw, rtprop > 0 and nbytes < PIPE_FILL_RTTS * btlbw * rtprop
        dur = float(getattr(report, "duration_s", 0.0) or 0.0)
        if nbytes >= MIN_RATE_SAMPLE_BYTES and dur > 0:
            # LTP with no BtlBw: its sender had not yet filled the pipe (a receiver sees the sender's estimate only
            # once STARTUP is over), so the goodput is its start-up pacing, not the path's rate
            unmeasured = raw is not None and hasattr(raw, "btlbw_bps")
            return nbytes / dur, unmeasured or (rtprop > 0 and dur < PIPE_FILL_RTTS * rtprop)
        return None

    def observe(self, report, *, src: str, dst: str) -> None:
        sample = self.sample(report)
        if sample is None:
            return
        rate, bound = sample
        self.samples += 1
        self.lower_bounds += bound
        for table, node in ((self.up, src), (self.down, dst)):
            old = table.get(node)
            if bound and (old is None or rate <= old):
                continue  # the path carries at least ``rate``: no news when the estimate is already that high
            table[node] = rate if old is None else (1 - RATE_EWMA) * old + RATE_EWMA * rate

    def next_deadline(self) -> float:
        return self._next

    def take(self, now: float):
        """``(up, down)`` copies when ``t_lag_s`` has passed since the last take, else None."""
        if now < self._next:
            return None
        self._next = now + self.t_lag_s
        if not self.up and not self.down:
            return None
        return dict(self.up), dict(self.down)


def transfer_events(me: str, steps, reports) -> list:
    """``TransferDone`` events for every receive of a grant stage (``me`` received; ok: a tolerant receive got
    bytes, a reliable one the whole message -- a chunk cut short is re-fetched, never relayed as held)."""
    out = []
    for s, r in zip(steps, reports):
        if s.op != "recv":
            continue
        ok = isinstance(r, RecvReport) and (r.complete if s.mode == RELIABLE else r.received_bytes > 0)
        out.append(TransferDone(s.peer, me, s.tag, ok, float(getattr(r, "duration_s", 0.0) or 0.0)))
    return out


def grant_uses_gradient(grant: Grant) -> bool:
    """True if ``grant`` consumes the node's own update (sends or combines ``grad``, or drops it)."""
    if grant.drop:
        return True
    return any(getattr(s, "slot", None) == SLOT_GRAD or getattr(s, "src", None) == SLOT_GRAD for s in grant.steps)


class ControllerDriver:
    """Hosts a controller: events in, grants out, per-node ordered delivery, timers, rate refresh.

    ``executor``/``slots``/``handlers``: the host node's own (its grants run
    there); ``deliver(node, grant)``: coroutine sending a grant to another node
    (``deliver_batch(node, grants)``, if given: several grants queued for one node at once go in one
    call, in order -- one control message instead of one round trip each)
    (returns normally or raises: a raise reports ``NodeFailed``);
    ``clock``: seconds (the loop's monotonic time by default).
    """

    def __init__(self, controller, executor: Executor, slots: Slots, handlers: Any = None, *,
                 deliver: Callable[[str, Grant], Awaitable[None]], clock: Callable[[], float] | None = None,
                 deliver_batch: Callable[[str, list], Awaitable[None]] | None = None,
                 t_lag_s: float = T_LAG_S, iteration: int = 0,
                 on_local_report: Callable[[Any, Any], None] | None = None,
                 on_grants: Callable[[list], None] | None = None):
        self.ctrl = controller
        self.executor = executor
        self.me = executor.me
        self.slots = slots
        self.handlers = handlers
        self.deliver = deliver
        self.deliver_batch = deliver_batch
        self.clock = clock or (lambda: asyncio.get_running_loop().time())
        self.iteration = iteration
        self.monitor = RateMonitor(t_lag_s, now=self.clock())
        self.on_local_report = on_local_report
        self.on_grants = on_grants
        self._queues: dict = {}
        self._tasks: dict = {}
        self._wake = asyncio.Event()
        self._timer: asyncio.Task | None = None
        self._closed = False
        self.failed: set = set()
        self.errors: list = []
        self.counters = {"grants": 0, "delivered": 0, "local": 0, "events": 0, "rate_updates": 0, "drops": 0}

    # -- events ---------------------------------------------------------------------------------------------------
    def start(self, nodes) -> None:
        """``controller.start`` over ``nodes`` and the timer task."""
        self._dispatch(self.ctrl.start(self.iteration, list(nodes), now=self.clock()))
        self._timer = asyncio.ensure_future(self._timer_loop())

    def revive(self, node: str) -> None:
        """``node`` joined again (a new incarnation after it was written off): it gets grants again, from the
        controller's ``admit``; what was still queued for the old incarnation is dropped."""
        self.failed.discard(node)
        q = self._queues.get(node)
        while q is not None and not q.empty():
            q.get_nowait()
        self._dispatch(self.ctrl.admit(node, now=self.clock()))
        self._wake.set()

    def feed(self, event) -> None:
        """One event for the controller; its grants are dispatched."""
        self.counters["events"] += 1
        if isinstance(event, NodeFailed):
            if event.node in self.failed:
                return
            self.failed.add(event.node)
        self._dispatch(self.ctrl.on_event(event, now=self.clock()))
        self._wake.set()

    def _dispatch(self, grants) -> None:
        if not grants:
            return
        if self.on_grants is not None:
            self.on_grants(grants)
        for g in grants:
            self.counters["grants"] += 1
            self.counters["drops"] += int(g.drop)
            if g.node in self.failed:
                continue
            key = self.queue_key(g)
            q = self._queues.get(key)
            if q is None:
                q = self._queues[key] = asyncio.Queue()
                self._tasks[key] = asyncio.ensure_future(self._node_loop(g.node, q))
            q.put_nowait(g)

    def queue_key(self, grant: Grant):
        """Which in-order queue runs ``grant``: one per node (a role may split its own node's grants into
        independent lanes, e.g. Hoplite's asynchronous PS receives one update while it broadcasts another)."""
        return grant.node

    # -- per node ---------------------------------------------------------------------------------------------------
    async def _node_loop(self, node: str, q: asyncio.Queue) -> None:
        carry = None  # a timed grant met while batching: it goes next, on its own
        while not self._closed:
            g, carry = (carry, None) if carry is not None else (await q.get(), None)
            if node in self.failed:
                continue
            try:
                if node == self.me:
                    await self._run_local(g)
                elif g.start_at is None and self.deliver_batch is not None and not q.empty():
                    batch = [g]
                    while not q.empty() and len(batch) < GRANTS_PER_BATCH:
                        nxt = q.get_nowait()
                        if nxt.start_at is not None:
                            carry = nxt
                            break
                        batch.append(nxt)
                    await self.deliver_batch(node, batch)
                    self.counters["delivered"] += len(batch)
                else:
                    if g.start_at is not None:
                        delay = g.start_at - self.clock()
                        if delay > 0:
                            await asyncio.sleep(delay)
                    await self.deliver(node, g)
                    self.counters["delivered"] += 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a node we cannot reach: the controller writes off what it held
                if node == self.me:
                    self.errors.append(exc)
                    continue
                self.feed(NodeFailed(node, f"grant delivery failed: {type(exc).__name__}: {exc}"))

    async def _run_local(self, g: Grant) -> None:
        if g.drop or not g.steps:
            return
        prog = Program(self.me, (tuple(g.steps),))
        res = await self.executor.run(prog, self.slots, self.handlers, iteration=self.iteration)
        self.counters["local"] += 1
        for s, r in zip(g.steps, res.reports):
            if s.op == "recv" and isinstance(r, RecvReport) and r.received_bytes > 0:
                self.monitor.observe(r, src=s.peer, dst=self.me)
            if self.on_local_report is not None and s.op in ("recv", "send"):
                self.on_local_report(s, r)
        for ev in transfer_events(self.me, g.steps, res.reports):
            self.feed(ev)

    # -- timers ---------------------------------------------------------------------------------------------------
    async def _timer_loop(self) -> None:
        while not self._closed:
            now = self.clock()
            rates = self.monitor.take(now)
            if rates is not None and hasattr(self.ctrl, "update_rates"):
                up, down = rates
                self.ctrl.update_rates(up, down, now=now)
                self.counters["rate_updates"] += 1
            due = self.ctrl.next_deadline()
            if due is not None and due <= now:
                self._dispatch(self.ctrl.on_timer(now=now))
                continue
            wake = self.monitor.next_deadline() if due is None else min(due, self.monitor.next_deadline())
            self._wake.clear()
            waiter = asyncio.ensure_future(self._wake.wait())
            try:  # not wait_for: on 3.11 it can swallow a cancellation that races the wake-up
                await asyncio.wait({waiter}, timeout=max(0.0, wake - self.clock()))
            finally:
                waiter.cancel()

    def busy(self) -> bool:
        """True while grants are queued or the controller is not done."""
        return any(not q.empty() for q in self._queues.values()) or not self.ctrl.done()

    async def close(self) -> None:
        """Cancel the timer and every node's queue."""
        self._closed = True
        self._wake.set()
        tasks = [t for t in [self._timer, *self._tasks.values()] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _retrieve(t: asyncio.Future) -> None:
    if not t.cancelled():
        t.exception()


class ControlChannel:
    """One node's control streams with one peer over the executor: ordered reliable JSON messages.

    ``send(msg)`` sends message ``k`` of this node's ``out_dir`` stream (one at
    a time, in order); ``recv(timeout)`` returns the next message of the
    ``in_dir`` stream, ``None`` on timeout, or raises :class:`ControlDecodeError`.
    A receive whose peer closed raises ``ConnectionError``.

    ``epoch`` keeps the streams of one incarnation of a worker apart from an earlier one's: a worker that was
    dropped and joined again (``rdv.join``'s ticket, known to both ends) starts new streams at sequence 0, and a
    message of the old streams still in flight or buffered can never be read as one of the new.
    """

    def __init__(self, executor: Executor, peer: str, *, out_dir: int, in_dir: int, patience_s: float | None = None,
                 epoch: int = 0):
        self.executor = executor
        self.epoch = int(epoch)
        self.peer = peer
        #: a send that times out (the peer did not acknowledge: paused, congested) is sent again, same message and
        #: sequence number, until this many seconds have passed (None: fail at once).  A peer that is gone
        #: (``PeerGone``) fails at once either way.  Workers use their ``--pull-timeout``: a PS paused for
        #: seconds must not cost them the job (its stream would also lose message ``k`` for good).
        self.patience_s = patience_s
        self.retries = 0
        #: messages sent again because the peer's receive closed without them (``TURNED_AWAY_RESENDS``)
        self.resends = 0
        #: messages of which part arrived before their sender went silent, read again (see :meth:`recv`)
        self.partial = 0
        self.out_dir, self.in_dir = out_dir, in_dir
        self.slots = Slots()
        self.out_seq = 0
        self.in_seq = 0
        self._inbuf = bytearray(CONTROL_BYTES)
        self.slots.bind("in", self._inbuf)
        self._lock = asyncio.Lock()
        self._inflight: asyncio.Future | None = None  # the message being sent

    async def send(self, msg: Mapping, *, timeout_s: float | None = None) -> None:
        """Send ``msg`` as this stream's next message; raises what the transfer raised.

        Once the message has its sequence number it goes, even if the caller is cancelled (a PS's driver closing
        with a grant on its way): the peer reads messages in sequence order, so a number taken and never sent
        would hide every later message, the STOP included, until the peer's timeout.  A cancelled caller leaves
        the transfer running on its own; the next ``send`` waits for it first, so messages still go one at a time.
        """
        data = encode_message(msg)
        async with self._lock:
            if self._inflight is not None:
                await asyncio.wait({self._inflight})  # a cancelled caller's message, still on its way
            tag = control_tag(self.out_seq, self.out_dir, self.epoch)
            self.out_seq += 1
            prog = Program(self.executor.me, ((Send(self.peer, "out", 0, 0, tag, RELIABLE, "grant",
                                                    timeout_s=timeout_s),),))
            self._inflight = asyncio.ensure_future(self._transmit(prog, data))
            self._inflight.add_done_callback(_retrieve)  # a cancelled caller's transfer fails unheard, not unlogged
            r = await asyncio.shield(self._inflight)
            self._inflight = None
        if isinstance(r, BaseException):
            raise r

    async def _transmit(self, prog: Program, data: bytes):
        """One message's transfer, retried while :attr:`patience_s` allows; returns its report or error."""
        slots = Slots()  # its own: a cancelled caller's transfer may still be reading it when the next is bound
        slots.bind("out", data)
        slots.bind_critical("out", ())
        t0 = time.monotonic()
        turned_away = 0
        while True:
            r = (await self.executor.run(prog, slots)).reports[0]
            if isinstance(r, SendReport) and r.close_reason == CloseReason.DEADLINE:
                # the peer's receive closed without it (it timed out, or we stalled half-way and it closed the
                # flow as idle): the message did not arrive, and the peer reads this sequence number again
                turned_away += 1
                if turned_away <= TURNED_AWAY_RESENDS or (self.patience_s is not None
                                                          and time.monotonic() - t0 < self.patience_s):
                    self.resends += 1
                    # backing off: a peer that reads again has posted its receive by now; one that does not
                    # turns each copy away within a round trip, which must not become a busy loop
                    await asyncio.sleep(min(RESEND_BACKOFF_MAX_S, RESEND_BACKOFF_S * 2 ** (turned_away - 1)))
                    continue
                return TransportTimeout(f"control message to {self.peer} turned away {turned_away} times (its "
                                        f"receive closed with {r.delivered_bytes}/{r.total_bytes} bytes in); the "
                                        f"peer no longer reads this stream")
            if not (isinstance(r, TimeoutError) and self.patience_s is not None
                    and time.monotonic() - t0 < self.patience_s):
                return r
            self.retries += 1  # the same message again: the receiver reads each sequence number once

    async def recv(self, timeout_s: float):
        tag = control_tag(self.in_seq, self.in_dir, self.epoch)
        end = time.monotonic() + timeout_s
        while True:
            prog = Program(self.executor.me, ((Recv(self.peer, "in", 0, 0, tag, RELIABLE, "grant",
                                                    timeout_s=max(0.0, end - time.monotonic())),),))
            r = (await self.executor.run(prog, self.slots)).reports[0]
            if isinstance(r, RecvReport) and r.regime == TIMEOUT and r.received_bytes > 0:
                # part of the message, then its sender went silent (paused half-way): the transport closed the
                # flow and told the sender, which sends the message again; read this sequence number again
                self.partial += 1
                if time.monotonic() < end:
                    continue
                return None
            break
        if not isinstance(r, RecvReport) or r.received_bytes == 0:
            if getattr(r, "regime", None) == CANCELLED:
                raise ConnectionError(f"{self.peer} closed the control stream")
            return None
        self.in_seq += 1
        return decode_message(self._inbuf, r.received_bytes)



STOP_TIMEOUT_S = 5.0  # seconds to tell one worker to stop


async def next_control_message(ch: ControlChannel, timeout_s: float, counters: dict, fail) -> dict | None:
    """The next decodable message on a PS's up-stream ``ch``, or None after ``fail(why)``.

    What every PS-side controller role (MLfabric's async PS, Hoplite's BSP PS) does with a
    worker's control stream: an undecodable message is counted and skipped; a closed stream or
    ``timeout_s`` of silence is counted (``closed`` / ``silent``) and reported through ``fail``.
    """
    from ..stall_watch import watch

    stall = watch()
    while True:
        t0 = stall.clock()
        try:
            msg = await ch.recv(timeout_s)
        except ControlDecodeError:
            counters["undecodable"] += 1
            continue
        except ConnectionError as exc:
            counters["closed"] += 1
            fail(f"its control stream closed ({exc})")
            return None
        if msg is None:
            if stall.stalled_since(t0):  # this process did not run for part of the window: the silence was ours
                counters["own_stall"] = counters.get("own_stall", 0) + 1
                continue
            counters["silent"] += 1
            fail(f"silent for {timeout_s:.0f} s")
            return None
        return msg


async def stop_workers(channels: Mapping, failed) -> None:
    """Tell every worker not in ``failed`` to stop, each within :data:`STOP_TIMEOUT_S`; dead ones are skipped."""
    async def one(n):
        try:
            await asyncio.wait_for(channels[n].send({"stop": True}, timeout_s=STOP_TIMEOUT_S), STOP_TIMEOUT_S)
        except Exception:
            pass  # a dead worker: nothing to tell

    await asyncio.gather(*(one(n) for n in channels if n not in failed))

class GrantFollower:
    """A node's side of a controller: run each grant from the host in order, report its receives.

    ``on_grant(grant)`` is called before a grant runs (roles bind slots);
    ``after_grant(grant, reports)`` after.  ``run()`` returns when the host
    sends ``{"stop": ...}``; a control stream silent for ``timeout_s`` raises
    ``TimeoutError`` (the host is gone).
    """

    def __init__(self, channel: ControlChannel, slots: Slots, handlers: Any = None, *, timeout_s: float,
                 after_grant: Callable[[Grant, list], None] | None = None):
        self.ch = channel
        self.executor = channel.executor
        self.me = channel.executor.me
        self.slots = slots
        self.handlers = handlers
        self.timeout_s = timeout_s
        self.after_grant = after_grant
        self.stop_message: dict | None = None
        self.counters = {"grants": 0, "undecodable": 0, "reported": 0}

    async def report(self, event) -> None:
        await self.ch.send(event_to_json(event))
        self.counters["reported"] += 1

    async def run(self) -> dict:
        while True:
            try:
                msg = await self.ch.recv(self.timeout_s)
            except ControlDecodeError:
                self.counters["undecodable"] += 1
                continue
            if msg is None:
                raise TimeoutError(f"{self.me}: no control message from {self.ch.peer} within {self.timeout_s:g} s")
            if "stop" in msg:
                self.stop_message = msg
                return msg
            try:
                g = Grant.from_json(msg["grant"])
            except (KeyError, TypeError, ValueError):
                self.counters["undecodable"] += 1
                continue
            self.counters["grants"] += 1
            reports: list = []
            if g.steps and not g.drop:
                res = await self.executor.run(Program(self.me, (tuple(g.steps),)), self.slots, self.handlers)
                reports = res.reports
                for ev in transfer_events(self.me, g.steps, reports):
                    await self.report(ev)
            if self.after_grant is not None:
                self.after_grant(g, reports)


__all__ = ["ControllerDriver", "ControlChannel", "GrantFollower", "RateMonitor", "ControlDecodeError",
           "control_tag", "params_tag", "encode_message", "decode_message", "event_to_json", "event_from_json",
           "transfer_events", "grant_uses_gradient", "T_LAG_S", "CONTROL_BYTES", "DOWN", "UP"]
