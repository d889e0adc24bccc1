"""A ``torch.distributed`` backend named ``ltp``: ``import ltp_ps; dist.init_process_group("ltp")``.

Theory of operation
-------------------
:class:`LtpProcessGroup` is a Python ``ProcessGroup`` (the extension point
torch offers third-party backends, registered with
``Backend.register_backend("ltp", ..., devices=["cpu"])``).  Every rank opens
one transport endpoint (LTP by default, TCP on request) on a private
event-loop thread and publishes its address in the store
``init_process_group`` handed to the backend (torchrun's TCPStore, already
prefixed per group by torch); then every rank reads every address.

A collective call (from any thread) takes the next *sequence number* of the
group (all ranks issue collectives in the same order, as torch requires),
turns the call into the steps of an algorithm (:mod:`ltp_ps.collectives`,
plain data) and submits one coroutine to the loop thread; it returns at once
with a ``Work`` wrapping a ``torch.futures.Future`` that the coroutine
completes, so ``async_op=True`` and DDP's reducer (which chains on the future)
work unchanged.  The message of step ``s`` of collective ``seq`` carries tag
``seq << STEP_BITS | s``; point-to-point messages use a disjoint tag space,
numbered per (peer, user tag) so they match in send order.

Every transfer here is **reliable** (bit-exact, LTP's reliable mode):
barriers, parameter broadcasts and the DDP reducer's default all-reduce are
never approximate.  Loss tolerance is opt-in for gradient reduction only,
through the DDP communication hook :func:`ltp_ps.ddp.register`.

The reduction *schedule* of a float32 sum/mean all-reduce (the gradients
DDP reduces) is an option: ``direct`` (via rank 0, PS-style, the plans of
:mod:`ltp_ps.collectives`), ``ring`` or ``rsgcm`` (schedule programs of
:mod:`ltp_ps.schedules`, run by its :class:`~ltp_ps.schedules.executor.Executor`
over this group's endpoint with every transfer reliable); ``auto`` (the
default) applies :func:`ltp_ps.collectives.default_schedule` per call.  Other
dtypes and ops, and the other collectives, run the plans of
:mod:`ltp_ps.collectives` (``ring`` plans where a ring/rsgcm schedule was
chosen).  Options come from ``init_process_group("ltp",
pg_options=BackendOptions(...))``, :func:`configure` or the environment:
``LTP_PG_SCHEDULE`` (``auto`` | ``direct`` | ``ring`` | ``rsgcm``),
``LTP_BACKEND_TRANSPORT`` (``ltp`` | ``tcp``), ``LTP_BACKEND_ALGORITHM``
(``auto`` | ``direct`` | ``ring``: the plans of the other collectives; an
explicit value also decides the all-reduce while the schedule is ``auto``),
``LTP_BACKEND_HOST`` / ``LTP_PS_ADVERTISE`` (bind / advertised address).

Failures: a transfer that does not finish within the group's timeout (the
``timeout=`` of ``init_process_group``) fails the collective with
:class:`LtpBackendError` (a ``torch.distributed.DistBackendError``) naming
this rank, the collective, its sequence number, the step, the peer and the
transport's own error.  A rank whose collective fails before its deadline tells the other ranks
(*abort notices*, a fixed-size reliable message on tag ``ABORT_TAG`` carrying
the sequence number and the reason; sent concurrently, each bounded by
``ABORT_NOTICE_TIMEOUT_S``).  Every rank keeps one receive posted for them
(a listener task on the loop thread): a notice for a collective this rank is
running fails it at once, naming the rank that failed and why; one for a
collective it has not reached yet fails that collective when it starts (the
failed rank will not take part).  Without them a mismatch that only some
ranks can see (a ring neighbour sent a message of the wrong size) left the
ranks that could not see it waiting for the whole group timeout, and their
next collective after it.  Point-to-point operations neither send nor heed
notices.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import os
import threading
import time

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ReduceOp

from . import collectives as C
from .errors import ConfigError
# imported here, in the importing thread, not lazily in the group's event-loop thread: CPython 3.11 builds ASTs with
# an interpreter-wide recursion counter, so two threads compiling modules at once can fail with "SystemError: AST
# constructor recursion depth mismatch". A torchrun test's rank 0 failed so once (session 57, just after these
# modules' sources changed, so they were compiled on import); which two compiles met was not caught
from .schedules.executor import Executor, Slots
from .schedules.partial import Partial
from .schedules.program import Program, worker
from .schedules.tags import MAX_ITERATION
from .torch_plugin import BACKEND_NAME, install
from .transport import open_transport
from .transport.ltp import LtpTransport

#: bits of a collective tag that number the steps of one collective (so at most 4096 steps)
STEP_BITS = 12
#: tags with this bit set are point-to-point messages
P2P_BIT = 1 << 63
#: bits of a p2p tag numbering the messages of one (peer, user tag) pair
P2P_COUNT_BITS = 30
#: a reliable send the transport gives up on is tried this many times in all, within the collective's timeout
#: (a duplicate that was in fact delivered waits unmatched in the receiver's bounded buffer)
SEND_ATTEMPTS = 3
#: pause before receiving again after a receive closed early (seconds)
RECV_RETRY_PAUSE_S = 0.05
#: seconds of silence from a peer that LTP tolerates before failing a transfer (starved, not dead)
PEER_SILENCE_S = 30.0
#: seconds to wait for the transport endpoint to open and for peers to publish their addresses
OPEN_TIMEOUT_S = 60.0
#: the tag of abort notices (bit 62, apart from collective, schedule and point-to-point tags)
ABORT_TAG = 1 << 62
#: bytes of one abort notice: sequence number (8), rank (4), reason (UTF-8, zero-padded)
ABORT_NOTICE_BYTES = 512
#: seconds a failed rank spends telling the others (all notices at once; a dead peer does not hold it longer)
ABORT_NOTICE_TIMEOUT_S = 2.0
#: a collective that fails with less than this left before its deadline timed out: no notice is sent (seconds)
ABORT_NOTICE_MIN_LEFT_S = 0.25
#: notices kept for collectives this rank has not reached (oldest dropped first)
ABORT_NOTICES_KEPT = 1024
ENV_TRANSPORT = "LTP_BACKEND_TRANSPORT"
ENV_ALGORITHM = "LTP_BACKEND_ALGORITHM"
ENV_HOST = "LTP_BACKEND_HOST"
ENV_SCHEDULE = "LTP_PG_SCHEDULE"


class LtpBackendError(dist.DistBackendError):
    """A collective of the ``ltp`` backend failed (timeout, peer gone, protocol violation)."""


class _Failed:
    """The value a base future is completed with when the operation failed (see :func:`completion`)."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


def _raise_failed(f: torch.futures.Future):
    v = f.value()
    if isinstance(v, _Failed):
        raise v.exc
    return v


def completion() -> tuple:
    """``(complete, fut)``: ``complete(value)`` or ``complete(exc, failed=True)`` finishes ``fut``.

    ``torch.futures.Future.set_exception`` stores the exception as the future's
    *value* (Python unwraps it), so C++ consumers such as DDP's reducer see a
    completed future and fail with "Unable to cast ... to Tensor".  Raising
    inside a ``then`` callback marks the child future as failed in C++ too, so
    DDP raises our message.
    """
    base: torch.futures.Future = torch.futures.Future()
    fut = base.then(_raise_failed)

    def complete(value, failed: bool = False) -> None:
        base.set_result(_Failed(value) if failed else value)

    return complete, fut


class LtpWork(dist.Work):
    """The ``Work`` of one collective: ``wait()`` raises its error; ``get_future()`` is what DDP chains on.

    (torch's ``_create_work_from_future`` wrapper does not re-raise the future's
    exception from ``wait()`` in torch 2.13, so a failed collective would look
    successful; this subclass waits on the future itself.)
    """

    def __init__(self, fut: torch.futures.Future):
        super().__init__()
        self._fut = fut
        self._exc: BaseException | None = None  # the collective's own error (wait() raises it, typed)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        try:
            self._fut.wait()
        except Exception:
            if self._exc is not None:
                raise self._exc from None
            raise
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        if not self._fut.done():
            return False
        try:
            self._fut.value()
        except Exception:  # noqa: BLE001
            return False
        return True

    def exception(self):
        try:
            self._fut.value()
        except Exception as exc:  # noqa: BLE001
            return self._exc or exc
        return None

    def get_future(self) -> torch.futures.Future:
        return self._fut

    def result(self):
        return self._fut.wait()

    def synchronize(self) -> None:
        pass


@dataclasses.dataclass
class BackendOptions:
    """Options of the ``ltp`` backend (``configure()`` or the environment)."""

    transport: str = "ltp"  # "ltp" | "tcp"
    algorithm: str = "auto"  # "auto" | "direct" | "ring"  (plans of the collectives)
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    schedule: str = "auto"  # "auto" | "direct" | "ring" | "rsgcm"  (float32 sum/mean all-reduce)

    @classmethod
    def from_env(cls) -> "BackendOptions":
        o = cls(transport=os.environ.get(ENV_TRANSPORT, "ltp"), algorithm=os.environ.get(ENV_ALGORITHM, "auto"),
                host=os.environ.get(ENV_HOST, os.environ.get("LTP_PS_HOST", "127.0.0.1")),
                advertise_host=os.environ.get("LTP_PS_ADVERTISE"), schedule=os.environ.get(ENV_SCHEDULE, "auto"))
        o.validate()
        return o

    def validate(self) -> None:
        if self.schedule not in ("auto",) + C.SCHEDULES:
            raise ConfigError(f"ltp backend: schedule {self.schedule!r} unknown; set {ENV_SCHEDULE} (or "
                              f"BackendOptions.schedule) to one of auto, {', '.join(C.SCHEDULES)}")
        if self.transport not in ("ltp", "tcp"):
            raise ConfigError(f"ltp backend: transport {self.transport!r} unknown; set {ENV_TRANSPORT}=ltp or tcp")
        if self.algorithm not in ("auto",) + C.ALGORITHMS:
            raise ConfigError(f"ltp backend: algorithm {self.algorithm!r} unknown; set {ENV_ALGORITHM} to one of "
                              f"auto, {', '.join(C.ALGORITHMS)}")


_configured: BackendOptions | None = None


def configure(**kw) -> BackendOptions:
    """Set the options of process groups created from now on (overrides the environment)."""
    global _configured
    o = dataclasses.replace(BackendOptions.from_env(), **kw)
    o.validate()
    _configured = o
    return o


async def open_tolerant_transport(kind: str, host: str, *, job_key: bytes | None = None,
                                  advertise_host: str | None = None, cc: str | None = None):
    """A transport endpoint whose LTP silence timers tolerate :data:`PEER_SILENCE_S` of a starved peer.

    LTP fails a transfer after ``peer_silence_min_s`` (1 s by default) without a
    word from the peer; a training process starved of CPU (or paused by the
    GC) for a second is not dead, and an exact collective must not fail for
    it.  Dead peers are still found: by ICMP unreachable at once, else by the
    collective's own timeout.
    """
    if kind == "ltp":
        return await LtpTransport.open(host, 0, job_key=job_key, advertise_host=advertise_host,
                                       config_kwargs={"peer_silence_min_s": PEER_SILENCE_S,
                                                      "idle_timeout_s": PEER_SILENCE_S})
    return await open_transport(kind, host, 0, cc=cc, job_key=job_key, advertise_host=advertise_host)


def _reduce_fn(op, dtypes=(), name: str = "reduce"):
    """(binary torch function, divide-by-world afterwards?) for a ReduceOp, after checking that the op applies
    to every dtype in ``dtypes``.  Every rank checks before anything is sent, so a misuse fails on all ranks at
    once with the same error (as gloo does) rather than on the rank that first combines, leaving the others
    waiting for it."""
    table = {ReduceOp.SUM: (torch.add, False), ReduceOp.AVG: (torch.add, True), ReduceOp.PRODUCT: (torch.mul, False),
             ReduceOp.MIN: (torch.minimum, False), ReduceOp.MAX: (torch.maximum, False),
             ReduceOp.BAND: (torch.bitwise_and, False), ReduceOp.BOR: (torch.bitwise_or, False),
             ReduceOp.BXOR: (torch.bitwise_xor, False)}
    for k, v in table.items():
        if op == k:
            break
    else:
        raise ConfigError(f"ltp backend: reduce op {op} is not supported; use SUM, AVG, PRODUCT, MIN, MAX, BAND, "
                          f"BOR or BXOR")
    got = sorted(map(str, set(dtypes)))
    op = k  # the table's own value: ReduceOp objects compare by == only
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) and any(d.is_floating_point or d.is_complex for d in dtypes):
        raise ConfigError(f"ltp backend: {name} with {op} needs integer or bool tensors, got {got}")
    if op == ReduceOp.AVG and any(not (d.is_floating_point or d.is_complex) for d in dtypes):
        raise ConfigError(f"ltp backend: {name} with ReduceOp.AVG needs floating-point tensors, got {got}")
    if op in (ReduceOp.MIN, ReduceOp.MAX) and any(d.is_complex for d in dtypes):
        raise ConfigError(f"ltp backend: {name} with {op} is undefined for complex tensors, got {got}")
    return v


def _bytes(t: torch.Tensor):
    """A writable byte view (numpy) of a contiguous CPU tensor, any dtype."""
    if not t.numel():
        return t.numpy()
    return _dense_strides(t).view(torch.uint8).numpy()


def _dense_strides(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous) viewed with the canonical row-major strides.  torch calls a tensor contiguous whatever
    the strides of its size-1 dimensions (``torch.tensor([1., 2.])[::2]`` has stride (2,)), and a byte view
    needs the last stride to be 1; the same memory, re-strided, is what the view must see."""
    if t.dim() == 0 or t.stride(-1) == 1 or not t.is_contiguous():
        return t  # (a tensor really strided is the caller's to copy: the byte view of it fails loudly)
    strides, step = [], 1
    for n in reversed(t.shape):
        strides.append(step)
        step *= n
    return t.as_strided(t.shape, tuple(reversed(strides)))


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)


class _Loop:
    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)


class LtpProcessGroup(dist.ProcessGroup):
    """The ``ltp`` process group.  Create it with ``dist.init_process_group("ltp")``, not directly."""

    def __init__(self, store, rank: int, world_size: int, timeout: datetime.timedelta,
                 options: BackendOptions | None = None):
        super().__init__(rank, world_size)
        self._rank, self._world = rank, world_size
        self._timeout_s = timeout.total_seconds() if timeout is not None else 1800.0
        self.options = options or _configured or BackendOptions.from_env()
        self.algorithm = self.options.algorithm
        self._seq = 0
        self._unfinished: set = set()  # collectives numbered here and not finished yet (under _lock)
        self._p2p_send: dict = {}
        self._p2p_recv: dict = {}
        self._lock = threading.Lock()
        self._closed = False
        #: readable counters: collectives and point-to-point operations started, failed, bytes sent/received by this rank
        self.stats = {"collectives": 0, "p2p": 0, "failed": 0, "bytes_sent": 0, "bytes_received": 0, "send_retries": 0,
                      "recv_retries": 0, "schedule_runs": 0, "aborts_sent": 0, "aborts_received": 0}
        self._io = _Loop(f"ltp-backend-{rank}")
        # LTP authenticates registrations with a job key when one is set ($LTP_PS_SECRET, as for the DDP hook).
        key = os.environ.get("LTP_PS_SECRET", "").encode() or None
        cf = self._io.submit(open_tolerant_transport(self.options.transport, self.options.host, job_key=key,
                                                     advertise_host=self.options.advertise_host))
        self._transport = cf.result(OPEN_TIMEOUT_S)
        a = self._transport.local_addr
        store.set(f"ltp/addr/{rank}", f"{a[0]}:{a[1]}")
        wait = max(self._timeout_s, OPEN_TIMEOUT_S)  # start-up, not a collective: ranks may start far apart
        keys = [f"ltp/addr/{r}" for r in range(world_size)]
        try:
            store.wait(keys, datetime.timedelta(seconds=wait))
        except Exception as exc:  # noqa: BLE001 - torch raises a plain RuntimeError/DistStoreError
            missing = [k for k in keys if not store.check([k])]
            raise LtpBackendError(f"ltp backend rank {rank}: ranks {missing} did not publish their address within "
                                  f"{wait:.0f} s ({exc}); did every rank call init_process_group('ltp')?") from exc
        self.peers = []
        for r in range(world_size):
            h, _, p = store.get(f"ltp/addr/{r}").decode().rpartition(":")
            self.peers.append((h, int(p)))
        self._node = worker(rank)
        self._nodes = {worker(r): p for r, p in enumerate(self.peers)}  # the executor's address book
        self._rsgcm_plan = None
        self._aborted: dict = {}  # seq -> (rank, reason) of notices received
        self._abort_waiters: dict = {}  # seq -> future failed by a notice for that running collective
        self._listener = self._io.submit(self._listen_for_aborts()) if world_size > 1 else None
        self.schedule = self.options.schedule
        if self.schedule == "rsgcm":
            self._ring_plan()  # plan now: a planning failure is a set-up error, not a failed collective
        engine = getattr(getattr(self._transport, "_ep", None), "engine", None)
        if key is not None and engine is not None:
            # REG MACs bind the source address; the endpoint does not tell its engine its own address
            # (ltp.Endpoint builds Engine without local_addr), so name it per peer here.
            for p in self.peers:
                engine.set_source(p, a)

    # -- identity ---------------------------------------------------------------------------------------------

    def getBackendName(self) -> str:
        return BACKEND_NAME

    @property
    def transport(self):
        """The transport endpoint (``ltp`` or ``tcp``) this group moves bytes with."""
        return self._transport

    def __repr__(self) -> str:
        return f"LtpProcessGroup(rank={self._rank}, world={self._world}, transport={self.options.transport})"

    # -- machinery --------------------------------------------------------------------------------------------

    def _start(self, name: str, coro_fn, result, *, p2p: bool = False) -> dist.Work:
        """Run ``coro_fn(seq, deadline)`` on the loop thread; a collective takes the group's next sequence number
        (every rank issues the same collectives in the same order, so the numbers agree). A point-to-point
        operation takes none (``seq`` None): only two ranks issue it, and counting it would put those two a
        number ahead of the others for every later collective; its wire tags count per (peer, tag) instead."""
        if self._closed:
            raise LtpBackendError(f"ltp backend rank {self._rank}: {name} on a shut-down process group")
        if p2p:
            seq = None
            self.stats["p2p"] += 1
        else:
            with self._lock:
                seq = self._seq
                self._seq += 1
                self._unfinished.add(seq)
            self.stats["collectives"] += 1
        complete, fut = completion()
        work = LtpWork(fut)
        deadline = time.monotonic() + self._timeout_s

        async def run():
            try:
                if p2p or self._world == 1:
                    await coro_fn(seq, deadline)
                else:
                    await self._run_collective(name, seq, coro_fn, deadline)
            finally:
                self._finished(seq)

        try:
            cf = self._io.submit(run())
        except BaseException:
            self._finished(seq)
            raise

        def done(f):
            exc = f.exception()
            if exc is None:
                complete(result)
                return
            self.stats["failed"] += 1
            if not isinstance(exc, LtpBackendError):
                exc = LtpBackendError(f"ltp backend rank {self._rank}: {name}{'' if p2p else f' #{seq}'} failed: "
                                      f"{type(exc).__name__}: {exc}")
            work._exc = exc
            complete(exc, failed=True)

        cf.add_done_callback(done)
        return work

    async def _run_collective(self, name: str, seq: int, coro_fn, deadline: float) -> None:
        """Run collective ``seq``; fail it at once on another rank's abort notice, and send notices if it fails
        here (see the module docstring)."""
        if seq in self._aborted:
            raise self._notice_error(name, seq, *self._aborted.pop(seq))
        told = self._io.loop.create_future()
        self._abort_waiters[seq] = told
        body = asyncio.ensure_future(coro_fn(seq, deadline))
        try:
            await asyncio.wait({body, told}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._abort_waiters.pop(seq, None)
        if not body.done():  # a notice came first
            body.cancel()
            await asyncio.gather(body, return_exceptions=True)
            raise self._notice_error(name, seq, *told.result())
        exc = body.exception()
        if exc is not None:
            # a failure at the deadline is a timeout: every rank waiting on this one meets its own deadline with its
            # own cause (which names the rank it waited for), so only an earlier failure is worth telling
            if time.monotonic() < deadline - ABORT_NOTICE_MIN_LEFT_S:
                await self._tell_abort(seq, f"{name} #{seq} failed on rank {self._rank}: {type(exc).__name__}: {exc}")
            raise exc

    def _notice_error(self, name: str, seq: int, rank: int, reason: str) -> "LtpBackendError":
        return LtpBackendError(f"ltp backend rank {self._rank}: {name} #{seq} failed: rank {rank} gave it up and "
                               f"told the group: {reason}")

    async def _tell_abort(self, seq: int, reason: str) -> None:
        """Send an abort notice for ``seq`` to every other rank, best effort, within ``ABORT_NOTICE_TIMEOUT_S``."""
        msg = np.zeros(ABORT_NOTICE_BYTES, np.uint8)
        head = seq.to_bytes(8, "little") + self._rank.to_bytes(4, "little")
        text = reason.encode("utf-8", "replace")[:ABORT_NOTICE_BYTES - len(head)]
        msg[:len(head) + len(text)] = np.frombuffer(head + text, np.uint8)

        async def one(peer):
            try:
                await self._transport.send(self.peers[peer], msg, reliable=True, tag=ABORT_TAG, element_size=1,
                                           timeout=ABORT_NOTICE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a dead or gone peer cannot be told; the failure is ours already
                pass
        await asyncio.gather(*(one(p) for p in range(self._world) if p != self._rank))
        self.stats["aborts_sent"] += 1

    async def _listen_for_aborts(self) -> None:
        """Keep one receive posted for abort notices; fail the running collective a notice names, or remember it."""
        buf = np.zeros(ABORT_NOTICE_BYTES, np.uint8)
        while not self._closed:
            try:
                rep = await self._transport.recv(buf, tag=ABORT_TAG, timeout=None)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a notice lost to a transport error is waited out by the timeout
                if self._closed:
                    return
                await asyncio.sleep(RECV_RETRY_PAUSE_S)
                continue
            if rep.received_bytes != ABORT_NOTICE_BYTES or rep.bubbles:
                continue  # not a whole notice: ignore it (every transfer of the group is reliable)
            raw = buf.tobytes()
            seq, rank = int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:12], "little")
            self._on_notice(seq, rank, raw[12:].rstrip(b"\0").decode("utf-8", "replace"))

    def _on_notice(self, seq: int, rank: int, reason: str) -> None:
        """Rank ``rank`` gave up collective ``seq``: fail it if it runs here, remember it if it has not finished."""
        self.stats["aborts_received"] += 1
        waiter = self._abort_waiters.get(seq)
        if waiter is not None:
            if not waiter.done():
                waiter.set_result((rank, reason))
        elif seq >= self._seq_floor():
            self._aborted[seq] = (rank, reason)
            while len(self._aborted) > ABORT_NOTICES_KEPT:
                self._aborted.pop(min(self._aborted))

    def _finished(self, seq: int | None) -> None:
        with self._lock:
            self._unfinished.discard(seq)

    def _seq_floor(self) -> int:
        """The lowest sequence number a notice may still concern: collectives below it finished here. A collective
        numbered on the caller's thread but not yet started on the loop counts as unfinished: a notice that arrives
        in between is kept for its start (before, it was dropped, and this rank waited for the group timeout)."""
        with self._lock:
            return min([self._seq, *self._unfinished])

    def _left(self, deadline: float) -> float:
        return max(0.001, deadline - time.monotonic())

    async def _send(self, buf: torch.Tensor, peer: int, tag: int, deadline: float, what: str) -> None:
        view = _bytes(buf)
        first = None  # the first attempt's failure: a later attempt with no time left only says "timeout"
        for attempt in range(SEND_ATTEMPTS):
            last = attempt == SEND_ATTEMPTS - 1 or time.monotonic() >= deadline or self._closed
            started = time.monotonic()
            try:
                rep = await self._transport.send(self.peers[peer], view, reliable=True, tag=tag, element_size=1,
                                                 timeout=self._left(deadline))
            except Exception as exc:  # noqa: BLE001 - name the real cause, keep it chained
                cause = f"{type(exc).__name__} after {time.monotonic() - started:.3g} s: {exc}"
                if not last:
                    first = first or cause
                    self.stats["send_retries"] += 1
                    continue  # the transport gave up early (e.g. the peer was starved of CPU): send again
                if first is not None:
                    cause += f"; the first attempt failed with {first}"
                raise LtpBackendError(f"ltp backend rank {self._rank}: {what}: sending {view.nbytes} bytes to "
                                      f"rank {peer} at {self.peers[peer]} failed ({attempt + 1} attempts): "
                                      f"{cause}") from exc
            if rep.delivered_bytes == view.nbytes:
                break
            if last:
                raise LtpBackendError(f"ltp backend rank {self._rank}: {what}: rank {peer} acknowledged "
                                      f"{rep.delivered_bytes} of {view.nbytes} bytes ({rep.close_reason}) in "
                                      f"{attempt + 1} attempts")
            self.stats["send_retries"] += 1  # the receiver closed the transfer early: it waits for a resend
        self.stats["bytes_sent"] += view.nbytes

    async def _recv(self, buf: torch.Tensor, peer: int, tag: int, deadline: float, what: str) -> None:
        view = _bytes(buf)
        stalled = None
        while True:
            try:
                rep = await self._transport.recv(view, peer=self.peers[peer], tag=tag, timeout=self._left(deadline))
            except Exception as exc:  # noqa: BLE001
                cause = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
                    cause = (f"no message within the group timeout of {self._timeout_s:g} s (rank {peer} is dead, "
                             f"stuck, or issued a different collective) [{cause}]")
                if stalled is not None:
                    cause += f"; an earlier attempt stalled: {stalled}"
                raise LtpBackendError(f"ltp backend rank {self._rank}: {what}: receiving {view.nbytes} bytes from "
                                      f"rank {peer} at {self.peers[peer]} failed: {cause}") from exc
            if rep.total_bytes != view.nbytes:
                raise LtpBackendError(f"ltp backend rank {self._rank}: {what}: rank {peer} sent {rep.total_bytes} "
                                      f"bytes, expected {view.nbytes}; ranks disagree on tensor shapes or dtypes")
            if rep.received_bytes == view.nbytes and not rep.bubbles:
                break
            # A reliable transfer the transport closed before it was complete (e.g. a peer starved of CPU):
            # the sender sees the failure and sends again (see _send); wait for that copy within the deadline.
            stalled = f"{rep.received_bytes} of {view.nbytes} bytes arrived (regime {rep.regime})"
            self.stats["recv_retries"] += 1
            if time.monotonic() >= deadline:
                raise LtpBackendError(f"ltp backend rank {self._rank}: {what}: the transfer from rank {peer} "
                                      f"stalled: {stalled}, and no resend arrived within the group timeout")
            await asyncio.sleep(RECV_RETRY_PAUSE_S)  # an unreachable peer answers at once: do not spin
        self.stats["bytes_received"] += view.nbytes

    async def _recv_into(self, t: torch.Tensor, peer: int, tag: int, deadline: float, what: str) -> None:
        buf = torch.empty(t.numel(), dtype=t.dtype)
        await self._recv(buf, peer, tag, deadline, what)
        t.copy_(buf.view_as(t))

    async def _run(self, seq: int, name: str, work: torch.Tensor, steps: list, deadline: float,
                   op=torch.add, step_base: int = 0) -> None:
        """Execute ``steps`` on the flat contiguous ``work`` buffer (tags from step ``step_base`` on)."""
        if step_base + len(steps) > 1 << STEP_BITS:
            raise ConfigError(f"ltp backend: {name} needs {step_base + len(steps)} steps, more than "
                              f"{1 << STEP_BITS}; use the direct algorithm or fewer dtypes per call")
        for si, step in enumerate(steps):
            tag = (seq << STEP_BITS) | (step_base + si)
            what = f"{name} #{seq} step {si + 1}/{len(steps)}"
            got = [(t, torch.empty(t.hi - t.lo, dtype=work.dtype)) for t in step.recvs]
            jobs = [self._recv(b, t.peer, tag, deadline, what) for t, b in got]
            jobs += [self._send(work[t.lo:t.hi], t.peer, tag, deadline, what) for t in step.sends]
            await _all_or_first_error(jobs)
            if step.combine == C.COPY:
                for t, b in got:
                    work[t.lo:t.hi].copy_(b)
                continue
            by_range: dict = {}
            for t, b in got:
                by_range.setdefault((t.lo, t.hi), []).append((t.peer, b))
            for (lo, hi), parts in by_range.items():
                parts.append((self._rank, work[lo:hi].clone()))
                parts.sort(key=lambda x: x[0])  # invariant 3: fold in rank order
                acc = parts[0][1]
                for _, b in parts[1:]:
                    acc = op(acc, b)
                work[lo:hi].copy_(acc)

    def _algo(self, nbytes: int) -> str:
        if self.algorithm != "auto":
            return self.algorithm
        if self.schedule in ("ring", "rsgcm") and self._world > 1:
            return "ring"
        if self.schedule == "direct":
            return "direct"
        return C.default_algorithm(self._world, nbytes)

    def _allreduce_route(self, dtype, op, n: int, elem: int) -> str:
        """``"direct"`` / ``"ring"`` (plans of :mod:`ltp_ps.collectives`) or ``"schedule:<name>"`` (executor)."""
        s = self.schedule
        if s == "auto":
            if self.algorithm != "auto":
                return self.algorithm  # an explicit algorithm keeps its meaning while the schedule is auto
            s = C.default_schedule(self._world, n * elem)
        if s == "direct" or self._world == 1 or n < self._world:
            return "direct"  # (fewer elements than ranks: the schedules' chunks would be empty)
        if dtype == torch.float32 and (op == ReduceOp.SUM or op == ReduceOp.AVG):
            return f"schedule:{s}"
        return "ring"  # schedule programs reduce float32 sums; other dtypes/ops take the ring plan

    def _ring_plan(self):
        """The RSGCM ring plan over this group's ranks (searched once, the same on every rank)."""
        if self._rsgcm_plan is None:
            try:
                self._rsgcm_plan = C.rsgcm_ring_plan(self._world)
            except Exception as exc:  # noqa: BLE001 - a planner failure names the fix
                raise ConfigError(f"ltp backend rank {self._rank}: the rsgcm schedule could not plan "
                                  f"{self._world} ranks ({type(exc).__name__}: {exc}); use schedule 'ring'") from exc
        return self._rsgcm_plan

    async def _run_schedule(self, seq: int, name: str, flat: torch.Tensor, schedule: str, deadline: float) -> None:
        """All-reduce (sum) the float32 ``flat`` in place with a schedule program on the executor, exactly."""
        it = seq & MAX_ITERATION  # tags pack(it, phase >= 2, ...) >= 2**32: apart from this group's plan tags
        prog = C.schedule_program(schedule, self._rank, self._world, flat.numel(), it,
                                  ring_plan=self._ring_plan() if schedule == "rsgcm" else None)
        ex = Executor(self._transport, self._node, self._nodes, timeout_s=self._left(deadline))
        into = _ExactSum(flat.numpy(), self._world)
        self.stats["schedule_runs"] += 1
        slots = Slots()
        steps = prog.steps()
        what = f"{name} #{seq} ({schedule} schedule)"
        done = 0
        # One stage at a time, so the first failed transfer ends the collective (an exact all-reduce cannot go on
        # without it) and every stage gets what is left of the collective's deadline.
        for stage in prog.stages:
            ex.timeout_s = self._left(deadline)
            res = await ex.run(Program(prog.node, (stage,)), slots, into, iteration=it)
            for k, (st, r) in enumerate(zip(stage, res.reports)):
                cause = self._transfer_failure(st, r)
                if cause is not None:
                    raise LtpBackendError(f"ltp backend rank {self._rank}: {what}: step {done + k + 1}/{len(steps)} "
                                          f"({st.op} elements [{st.lo}, {st.hi}) "
                                          f"{'from' if st.op == 'recv' else 'to'} rank {st.peer.partition(':')[2]}) "
                                          f"failed: {cause}")
                if st.op in ("send", "forward"):
                    self.stats["bytes_sent"] += r.delivered_bytes
                elif st.op == "recv":
                    self.stats["bytes_received"] += r.received_bytes
            for i, why in res.missing:  # arrived whole, yet unusable: e.g. a partial over other elements
                st = stage[i]
                raise LtpBackendError(f"ltp backend rank {self._rank}: {what}: step {done + i + 1}/{len(steps)} "
                                      f"({st.op} elements [{st.lo}, {st.hi}) from rank {st.peer.partition(':')[2]}) "
                                      f"failed: {why}; ranks disagree on tensor shapes or dtypes")
            done += len(stage)
        if into.bad:
            raise LtpBackendError(f"ltp backend rank {self._rank}: {what}: {into.bad[0]}")

    def _transfer_failure(self, st, r) -> str | None:
        """Why the executor's report ``r`` of transfer step ``st`` is not a whole reliable transfer (else None)."""
        if st.op not in ("send", "recv", "forward"):
            return None
        peer = st.peer.partition(":")[2]
        if isinstance(r, BaseException):
            return f"{type(r).__name__}: {r}"
        if r is None:
            return "the executor ran no transfer"
        if st.op == "recv":
            if r.received_bytes == 0 or r.received_bytes < r.total_bytes or r.bubbles:
                return (f"received {r.received_bytes} of {r.total_bytes or '?'} bytes ({r.regime}); rank {peer} is "
                        f"dead, stuck, or issued a different collective (group timeout {self._timeout_s:g} s)")
            return None
        if r.delivered_bytes < r.total_bytes:
            return f"rank {peer} acknowledged {r.delivered_bytes} of {r.total_bytes} bytes ({r.close_reason})"
        return None

    # -- collectives ------------------------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None) -> dist.Work:
        op = opts.reduceOp if opts is not None else ReduceOp.SUM
        return self._allreduce_many(list(tensors), op, "allreduce")

    def allreduce_coalesced(self, tensors, opts=None) -> dist.Work:
        op = opts.reduceOp if opts is not None else ReduceOp.SUM
        return self._allreduce_many(list(tensors), op, "allreduce_coalesced")

    def _allreduce_many(self, tensors, op, name) -> dist.Work:
        _check_cpu(tensors, name)
        fn, avg = _reduce_fn(op, [t.dtype for t in tensors], name)
        groups: dict = {}
        for t in tensors:
            groups.setdefault(t.dtype, []).append(t)

        async def go(seq, deadline):
            base = 0
            for dtype, ts in groups.items():  # one group per dtype: at most one float32 group per call
                flat = torch.cat([_flat(t) for t in ts]) if len(ts) > 1 else _flat(ts[0]).contiguous().clone()
                route = self._allreduce_route(dtype, op, flat.numel(), flat.element_size())
                if route.startswith("schedule:"):
                    await self._run_schedule(seq, name, flat, route.partition(":")[2], deadline)
                else:
                    steps = C.allreduce_plan(route, self._rank, self._world, flat.numel())
                    await self._run(seq, name, flat, steps, deadline, fn, step_base=base)
                    base += len(steps)
                if avg:
                    flat.div_(self._world)
                off = 0
                for t in ts:
                    t.copy_(flat[off:off + t.numel()].view_as(t))
                    off += t.numel()

        return self._start(name, go, tensors)

    def broadcast(self, tensors, opts=None) -> dist.Work:
        root = opts.rootRank if opts is not None else 0
        tensors = list(tensors)
        _check_cpu(tensors, "broadcast")

        if len(tensors) > 1 << STEP_BITS:
            raise ConfigError(f"ltp backend: broadcast of more than {1 << STEP_BITS} tensors in one call")

        async def go(seq, deadline):
            what = f"broadcast #{seq} from rank {root}"
            jobs = []
            for i, t in enumerate(tensors):  # one message per tensor (dtypes may differ)
                if not t.numel():
                    continue
                tag = (seq << STEP_BITS) | i
                if self._rank == root:
                    flat = _flat(t).contiguous()
                    jobs += [self._send(flat, p, tag, deadline, what) for p in range(self._world) if p != root]
                else:
                    jobs.append(self._recv_into(t, root, tag, deadline, what))
            await _all_or_first_error(jobs)

        return self._start("broadcast", go, tensors)

    def reduce(self, tensors, opts=None) -> dist.Work:
        """Reduce to ``opts.rootRank`` (implemented as an all-reduce; non-roots' tensors are left unchanged)."""
        root = opts.rootRank if opts is not None else 0
        op = opts.reduceOp if opts is not None else ReduceOp.SUM
        tensors = list(tensors)
        _check_cpu(tensors, "reduce")
        fn, avg = _reduce_fn(op, [t.dtype for t in tensors], "reduce")

        async def go(seq, deadline):
            flat = _flat(tensors[0]).contiguous().clone()
            await self._run(seq, "reduce", flat, C.allreduce_plan(self._algo(flat.numel() * flat.element_size()),
                                                                  self._rank, self._world, flat.numel()),
                            deadline, fn)
            if avg:
                flat.div_(self._world)
            if self._rank == root:
                tensors[0].copy_(flat.view_as(tensors[0]))

        return self._start("reduce", go, tensors)

    def allgather(self, output_tensors, input_tensors, opts=None) -> dist.Work:
        outs, ins = list(output_tensors), list(input_tensors)
        if len(ins) != 1 or len(outs) != 1:
            raise ConfigError("ltp backend: allgather takes one input tensor per rank (a list of one)")
        outs0 = list(outs[0])
        if len(outs0) != self._world:
            raise ConfigError(f"ltp backend: allgather needs {self._world} output tensors, got {len(outs0)}")
        _check_cpu(outs0 + ins, "allgather")
        odd = [r for r, o in enumerate(outs0) if o.numel() != ins[0].numel() or o.dtype != ins[0].dtype]
        if odd:  # checked on every rank before anything is sent: uneven sizes fail everywhere at once
            raise ConfigError(f"ltp backend: allgather needs every output tensor to match the input "
                              f"({ins[0].numel()} x {ins[0].dtype}); output {odd[0]} has {outs0[odd[0]].numel()} x "
                              f"{outs0[odd[0]].dtype} (uneven all_gather is not supported, as with gloo)")
        return self._gather_into("allgather", outs0, ins[0], outs)

    def all_gather_single(self, output_tensor, input_tensor, opts=None) -> dist.Work:
        if output_tensor.numel() != input_tensor.numel() * self._world:
            raise ConfigError(f"ltp backend: all_gather_into_tensor output has {output_tensor.numel()} elements, "
                              f"needs world_size x input = {input_tensor.numel() * self._world}")
        return self._gather_into("all_gather_into_tensor", None, input_tensor, output_tensor, single=output_tensor)

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists, input_list, opts=None) -> dist.Work:
        works = [self.allgather([list(o)], [i]) for o, i in zip(output_lists, input_list)]
        return _chain(works, output_lists)

    def _gather_into(self, name, outs, inp, result, single=None) -> dist.Work:
        n = inp.numel()
        dtype = inp.dtype
        if single is not None and single.dtype != dtype:
            raise ConfigError(f"ltp backend: {name}: output dtype {single.dtype} != input dtype {dtype}")

        async def go(seq, deadline):
            work = torch.empty(n * self._world, dtype=dtype)
            work[self._rank * n:(self._rank + 1) * n].copy_(_flat(inp))
            bounds = [r * n for r in range(self._world + 1)]
            algo = self._algo(n * self._world * inp.element_size())
            await self._run(seq, name, work, C.allgather_plan(algo, self._rank, self._world, bounds), deadline)
            if single is not None:
                single.copy_(work.view_as(single))
            else:
                for r, o in enumerate(outs):
                    o.copy_(work[r * n:(r + 1) * n].view_as(o))

        return self._start(name, go, result)

    def reduce_scatter(self, output_tensors, input_lists, opts=None) -> dist.Work:
        op = opts.reduceOp if opts is not None else ReduceOp.SUM
        outs, ins = list(output_tensors), list(input_lists)
        if len(outs) != 1 or len(ins) != 1 or len(ins[0]) != self._world:
            raise ConfigError(f"ltp backend: reduce_scatter takes one output and a list of {self._world} inputs")
        parts = list(ins[0])
        _check_cpu(parts + outs, "reduce_scatter")
        return self._reduce_scatter("reduce_scatter", outs[0], parts, op, outs)

    def reduce_scatter_single(self, output_tensor, input_tensor, opts=None) -> dist.Work:
        op = opts.reduceOp if opts is not None else ReduceOp.SUM
        if input_tensor.numel() != output_tensor.numel() * self._world:
            raise ConfigError(f"ltp backend: reduce_scatter_tensor input has {input_tensor.numel()} elements, "
                              f"needs world_size x output = {output_tensor.numel() * self._world}")
        n = output_tensor.numel()
        flat = _flat(input_tensor)
        return self._reduce_scatter("reduce_scatter_tensor", output_tensor,
                                    [flat[r * n:(r + 1) * n] for r in range(self._world)], op, output_tensor)

    _reduce_scatter_base = reduce_scatter_single

    def _reduce_scatter(self, name, out, parts, op, result) -> dist.Work:
        fn, avg = _reduce_fn(op, [out.dtype] + [p.dtype for p in parts], name)

        async def go(seq, deadline):
            work = torch.cat([_flat(p) for p in parts])
            bounds = [0]
            for p in parts:
                bounds.append(bounds[-1] + p.numel())
            algo = self._algo(work.numel() * work.element_size())
            await self._run(seq, name, work, C.reduce_scatter_plan(algo, self._rank, self._world, bounds),
                            deadline, fn)
            mine = work[bounds[self._rank]:bounds[self._rank + 1]]
            if avg:
                mine = mine / self._world
            out.copy_(mine.view_as(out))

        return self._start(name, go, result)

    def alltoall(self, output_tensors, input_tensors, opts=None) -> dist.Work:
        outs, ins = list(output_tensors), list(input_tensors)
        if len(outs) != self._world or len(ins) != self._world:
            raise ConfigError(f"ltp backend: alltoall takes {self._world} input and output tensors")
        _check_cpu(outs + ins, "alltoall")

        async def go(seq, deadline):
            what = f"alltoall #{seq}"
            tag = seq << STEP_BITS
            jobs = [self._send(_flat(ins[p]).contiguous(), p, tag, deadline, what)
                    for p in range(self._world) if p != self._rank and ins[p].numel()]
            bufs = {p: torch.empty(outs[p].numel(), dtype=outs[p].dtype) for p in range(self._world)
                    if p != self._rank and outs[p].numel()}
            jobs += [self._recv(b, p, tag, deadline, what) for p, b in bufs.items()]
            await _all_or_first_error(jobs)
            outs[self._rank].copy_(ins[self._rank].view_as(outs[self._rank]))
            for p, b in bufs.items():
                outs[p].copy_(b.view_as(outs[p]))

        return self._start("alltoall", go, outs)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None) -> dist.Work:
        w = self._world
        row_out = output.numel() // max(1, output.shape[0]) if output.dim() else 1
        row_in = input.numel() // max(1, input.shape[0]) if input.dim() else 1
        osz = list(output_split_sizes) or [output.shape[0] // w] * w
        isz = list(input_split_sizes) or [input.shape[0] // w] * w
        if sum(osz) != output.shape[0] or sum(isz) != input.shape[0]:
            raise ConfigError("ltp backend: all_to_all_single split sizes do not add up to the tensors' first dim")
        outs = list(torch.split(output, osz)) if output.numel() else [output[:0]] * w
        ins = list(torch.split(input, isz)) if input.numel() else [input[:0]] * w
        del row_out, row_in
        return self.alltoall(outs, ins, opts)

    alltoall_base = all_to_all_single

    def barrier(self, opts=None) -> dist.Work:
        t = torch.zeros(1)

        async def go(seq, deadline):
            await self._run(seq, "barrier", t, C.direct_allreduce(self._rank, self._world, 1), deadline)

        return self._start("barrier", go, [t])

    def monitored_barrier(self, opts=None, wait_all_ranks=False):
        return self.barrier(opts).wait()

    def gather(self, output_lists, input_tensors, opts=None) -> dist.Work:
        root = opts.rootRank if opts is not None else 0
        inp = list(input_tensors)[0]
        outs = list(output_lists[0]) if self._rank == root and len(output_lists) else []

        async def go(seq, deadline):
            tag, what = seq << STEP_BITS, f"gather #{seq} to rank {root}"
            if self._rank != root:
                if inp.numel():
                    await self._send(_flat(inp).contiguous(), root, tag, deadline, what)
                return
            bufs = {p: torch.empty(outs[p].numel(), dtype=outs[p].dtype) for p in range(self._world)
                    if p != root and outs[p].numel()}
            await _all_or_first_error([self._recv(b, p, tag, deadline, what) for p, b in bufs.items()])
            outs[root].copy_(inp.view_as(outs[root]))
            for p, b in bufs.items():
                outs[p].copy_(b.view_as(outs[p]))

        return self._start("gather", go, list(output_lists))

    def scatter(self, output_tensors, input_lists, opts=None) -> dist.Work:
        root = opts.rootRank if opts is not None else 0
        out = list(output_tensors)[0]
        ins = list(input_lists[0]) if self._rank == root and len(input_lists) else []

        async def go(seq, deadline):
            tag, what = seq << STEP_BITS, f"scatter #{seq} from rank {root}"
            if self._rank == root:
                await _all_or_first_error([self._send(_flat(ins[p]).contiguous(), p, tag, deadline, what)
                                           for p in range(self._world) if p != root and ins[p].numel()])
                out.copy_(ins[root].view_as(out))
                return
            if out.numel():
                buf = torch.empty(out.numel(), dtype=out.dtype)
                await self._recv(buf, root, tag, deadline, what)
                out.copy_(buf.view_as(out))

        return self._start("scatter", go, [out])

    # -- point to point ---------------------------------------------------------------------------------------

    def _p2p_tag(self, table: dict, peer: int, tag: int) -> int:
        with self._lock:
            k = (peer, tag)
            n = table.get(k, 0)
            table[k] = n + 1
        return P2P_BIT | ((tag & 0xFFFFFFFF) << P2P_COUNT_BITS) | (n & ((1 << P2P_COUNT_BITS) - 1))

    def send(self, tensors, dst: int, tag: int = 0) -> dist.Work:
        t = list(tensors)[0]
        _check_cpu([t], "send")
        wire_tag = self._p2p_tag(self._p2p_send, dst, tag)
        data = _flat(t).contiguous().clone()

        async def go(seq, deadline):
            if data.numel():
                await self._send(data, dst, wire_tag, deadline, f"send (tag {tag}) to rank {dst}")

        return self._start("send", go, [t], p2p=True)

    def recv(self, tensors, src: int, tag: int = 0) -> dist.Work:
        t = list(tensors)[0]
        _check_cpu([t], "recv")
        wire_tag = self._p2p_tag(self._p2p_recv, src, tag)

        async def go(seq, deadline):
            if t.numel():
                buf = torch.empty(t.numel(), dtype=t.dtype)
                await self._recv(buf, src, wire_tag, deadline, f"recv (tag {tag}) from rank {src}")
                t.copy_(buf.view_as(t))

        return self._start("recv", go, [t], p2p=True)

    def recv_anysource(self, tensors, tag: int = 0) -> dist.Work:
        raise ConfigError("ltp backend: recv from any source is not supported; pass src= to dist.recv")

    # -- lifetime ---------------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Close the endpoint and stop the loop thread (``destroy_process_group`` calls this)."""
        if self._closed:
            return
        self._closed = True
        if self._listener is not None:
            self._listener.cancel()
        try:
            asyncio.run_coroutine_threadsafe(self._transport.close(), self._io.loop).result(10)
        except Exception:  # noqa: BLE001 - closing a broken endpoint must not mask the real error
            pass
        self._io.loop.call_soon_threadsafe(self._io.loop.stop)

    abort = shutdown

    def _set_sequence_number_for_group(self) -> None:
        pass


async def _all_or_first_error(coros) -> None:
    """Run ``coros`` together; if one fails, cancel the rest and raise its error."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    if not tasks:
        return
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise
    for t in pending:
        t.cancel()
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is not None:
            raise t.exception()


class _ExactSum:
    """The executor's handler for an exact all-reduce: the rank's tensor in, every rank's sum out (in place).

    ``Compute`` puts this rank's values in as a partial; ``Adopt`` copies the
    sum of a reduced piece back, but only if it holds all ``world``
    contributions for every element (an exact collective never averages over
    fewer); anything else is recorded in ``bad`` and fails the collective.
    """

    def __init__(self, buf: np.ndarray, world: int):
        self.buf, self.world, self.bad = buf, world, []

    def compute(self, step, slots):
        slots.put_partial(step.slot, Partial.of_gradient(self.buf))

    def adopt(self, step, slots):
        p = slots.partial(step.slot, step.lo, step.hi)
        if p is None or p.contributors != self.world or (p.deficit is not None and p.deficit.any()):
            got = "nothing" if p is None else f"{p.contributors} contributions (deficit {p.deficit_runs()[:3]})"
            self.bad.append(f"elements [{step.lo}, {step.hi}) reduced to {got}, expected all {self.world} ranks")
            return
        self.buf[step.lo:step.hi] = p.sum

    def apply(self, step, slots):
        return None  # the caller owns the result (DDP's reducer, the user's tensor)


def _chain(works, result) -> dist.Work:
    complete, fut = completion()
    out = LtpWork(fut)

    def done(_):
        for w in works:
            exc = w.exception()
            if exc is not None:
                out._exc = exc
                complete(exc, failed=True)
                return
        complete(result)

    torch.futures.collect_all([w.get_future() for w in works]).add_done_callback(done)
    return out


def _check_cpu(tensors, name: str) -> None:
    for t in tensors:
        if t.device.type != "cpu":
            raise ConfigError(f"ltp backend: {name} got a {t.device.type} tensor; the ltp backend moves CPU tensors "
                              f"(use backend='cpu:ltp,cuda:nccl' to keep accelerators on their own backend)")


def _create(opts, pg_options=None) -> LtpProcessGroup:
    """torch's extended creator API: ``opts`` carries store/rank/size/timeout; ``pg_options`` is what the user
    passed as ``init_process_group(..., pg_options=)`` (a :class:`BackendOptions`, a dict of its fields, or None)."""
    if pg_options is None:
        options = None
    elif isinstance(pg_options, BackendOptions):
        options = pg_options
    elif isinstance(pg_options, dict):
        options = dataclasses.replace(_configured or BackendOptions.from_env(), **pg_options)
    else:
        raise ConfigError(f"ltp backend: pg_options must be ltp_ps.backend.BackendOptions or a dict of its fields, "
                          f"got {type(pg_options).__name__}")
    if options is not None:
        options.validate()
    return LtpProcessGroup(opts.store, opts.group_rank, opts.group_size, opts.timeout, options)


def register() -> None:
    """Register ``ltp`` with ``torch.distributed`` (idempotent; ``import ltp_ps`` or ``import torch`` does it, see
    :mod:`ltp_ps.torch_plugin`). Raises what torch raises."""
    install()


__all__ = ["BackendOptions", "LtpBackendError", "LtpProcessGroup", "LtpWork", "completion", "configure", "register"]
