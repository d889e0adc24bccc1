"""PyTorch drop-in: a DDP communication hook that averages gradient buckets through a PS over LTP.

Two lines switch an existing DDP script (any process-group backend: ``gloo``
or ``ltp``)::

    import ltp_ps.ddp                     # <- LTP line 1
    model = DistributedDataParallel(net)
    ltp_ps.ddp.register(model)            # <- LTP line 2

How it works
------------
* ``register`` reads rank and world size from the process group and uses the
  group's own store (the TCPStore torchrun / ``init_process_group`` created)
  for rendezvous under the prefix ``ltp_ps_ddp/``: rank 0 starts an
  aggregation PS (:class:`BucketServer`) on a background event-loop thread of
  its own process; every rank (rank 0 included) opens a transport endpoint on
  that thread and publishes its address.
* The hook runs for every bucket in bucket order (DDP's reducer launches hooks
  in index order on every rank, so a per-process round counter names the same
  bucket everywhere).  Each bucket goes to the PS loss-tolerantly (header and
  first/last element of every parameter critical) after a tiny reliable READY
  note; the PS gathers all ranks with one Early Close deadline, decides
  (:class:`RoundPolicy`), and answers every rank reliably.

The round protocol (theory of operation)
----------------------------------------
The PS's answer to round ``r`` is one of three things, always sent to *every*
rank, so no round ever ends with ranks waiting out their timeout:

``RESULT``  the mean of the bucket.  Contributions that arrived whole are
            used as they are; a contribution that lost some packets *on a
            lossy path* (holes in what arrived) and still delivered at least
            ``min_fraction`` is used with the unbiased per-element mean.
``RESEND``  some contributions are not usable as they are: nothing arrived,
            a critical range is missing, less than ``min_fraction`` arrived,
            or the transfer was *cut without evidence of loss* (only a tail is
            missing: the sender was slower than Early Close expected, which is
            not a lossy link).  The listed ranks resend their bucket
            **reliably**; then the PS sends ``RESULT`` (or ``ERROR``).  A bucket
            with no contribution is therefore never applied as zeros.
``ERROR``   the round cannot complete (a rank is dead, layouts disagree, the
            PS failed); every rank's hook future fails with
            :class:`~ltp_ps.backend.LtpBackendError` (a
            ``torch.distributed.DistBackendError``) naming rank, bucket, round
            and cause.

Every rank counts what happened (:class:`HookStats`, ``state.stats``; the PS
puts its round summary in each answer) and a rate-limited ``RuntimeWarning``
says when rounds were partial or repaired.  No optimizer runs at this PS:
DDP's local optimizers stay in charge, exactly as with allreduce.

Transport: ``transport="auto"`` (default, or ``$LTP_PS_TRANSPORT``) uses LTP
when ``ltp.open_endpoint`` exists and TCP otherwise, and says which on rank 0.
The job secret is ``$LTP_PS_SECRET`` if set.  See ``docs/ddp.md``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import struct
import threading
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist

from .aggregate import limit_ranges
from .backend import LtpBackendError, completion, open_tolerant_transport
from .errors import ConfigError, RemoteError
from .transport import resolve_kind
from .transport.base import TIMEOUT, gather_by_recv, missing_report

# --- message layouts and tags (hook endpoints are private to the hook: their tags are ours) ------------------

GRAD_MAGIC = b"LTPB"
_GRAD = struct.Struct("<4sIqqqd")  # magic, rank, round, bucket index, n elements, sender's recent path loss rate
REPLY_MAGIC = b"LTPR"
# magic, status, round, bucket, n, partial ranks, repaired ranks, min delivered fraction, cut-without-loss ranks
_REPLY = struct.Struct("<4sIqqqIIdI")
HDR = 64  # bytes reserved for either header
ELEM = 4  # bytes per float32
READY_BYTES = 8
ERROR_TEXT_BYTES = 1024  # room for an ERROR answer's text

RESULT, RESEND, ERROR = 0, 1, 2
STATUS_NAMES = {RESULT: "result", RESEND: "resend", ERROR: "error"}

K_GRAD, K_READY, K_REPLY, K_REPAIR, K_FINAL = 1, 2, 3, 4, 5
TAG_KINDS = 8


def hook_tag(rnd: int, kind: int) -> int:
    """The tag of message ``kind`` of round ``rnd`` on the hook's endpoints."""
    return rnd * TAG_KINDS + kind


#: default smallest delivered fraction of a lossy contribution that is used as it is (else repaired)
MIN_FRACTION = 0.8
#: a sender's path loss rate is measured over its last this many transfers to the PS
LOSS_WINDOW = 16
#: reliable transfers the transport gave up on are tried this many times in all (within the timeout)
SEND_ATTEMPTS = 3
#: a rank waits this many timeouts (+ slack) for the PS's answer: the PS's own bounded waits come first
REPLY_WAIT_TIMEOUTS = 2
REPLY_WAIT_SLACK_S = 5.0  # seconds
#: at most one warning of each kind per this many seconds
WARN_INTERVAL_S = 30.0


def reply_bytes(n: int, world: int) -> int:
    """Size of an answer buffer: header + max(the bucket, one byte per rank, the error text)."""
    return HDR + max(ELEM * n, world, ERROR_TEXT_BYTES)


# --- the sans-IO decision ---------------------------------------------------------------------------------------

ACCEPT_FULL, ACCEPT_LOSSY, REPAIR = "full", "lossy", "repair"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the PS does with one rank's contribution to one round, and why."""

    rank: int
    action: str  # ACCEPT_FULL | ACCEPT_LOSSY | REPAIR
    reason: str
    fraction: float
    lost: tuple = ()  # element ranges missing from an ACCEPT_LOSSY contribution


class RoundPolicy:
    """Decides per contribution: use it whole, use it with its holes, or have it resent reliably.

    Pure: takes the receive reports and parsed headers, returns :class:`Verdict`s.
    The rules, in order:

    1. nothing arrived, the header is missing or names another round/size,
       or a critical range is missing  -> REPAIR;
    2. everything arrived -> ACCEPT_FULL;
    3. the sender's path lost nothing in its last :data:`LOSS_WINDOW`
       transfers (its own loss count, carried in the header), or only a tail
       is missing -> REPAIR ("cut without loss": the sender was slower than
       Early Close expected, which is not a lossy link);
    4. less than ``min_fraction`` arrived -> REPAIR;
    5. otherwise -> ACCEPT_LOSSY (the loss-tolerant case the paper designs for).

    Finally, if some element was delivered by no accepted contribution, every
    ACCEPT_LOSSY contribution is turned into REPAIR, so no element is ever
    averaged over zero ranks.
    """

    def __init__(self, min_fraction: float = MIN_FRACTION):
        if not 0.0 <= min_fraction <= 1.0:
            raise ConfigError(f"min_fraction={min_fraction}: use a value in [0, 1] (1 = never accept a lossy bucket)")
        self.min_fraction = min_fraction

    def decide(self, rnd: int, n: int, reports: list, headers: list) -> list[Verdict]:
        out = []
        total = HDR + ELEM * n
        for rank, (rep, h) in enumerate(zip(reports, headers)):
            f = float(rep.delivered_fraction)
            if rep.received_bytes <= 0:
                out.append(Verdict(rank, REPAIR, f"nothing arrived ({rep.regime})", 0.0))
            elif h is None or h[1] != rnd or h[3] != n or h[0] != rank:
                out.append(Verdict(rank, REPAIR, "header missing or for another round/size", f))
            elif not rep.critical_complete:
                out.append(Verdict(rank, REPAIR, "a critical range is missing", f))
            elif not rep.bubbles and rep.received_bytes >= rep.total_bytes:
                out.append(Verdict(rank, ACCEPT_FULL, "complete", 1.0))
            elif h[4] <= 0.0 or _tail_only(rep.bubbles, rep.total_bytes or total):
                why = "only the tail is missing" if h[4] > 0.0 else "the sender's path lost no packet recently"
                out.append(Verdict(rank, REPAIR, f"cut at {f:.1%} without loss ({why})", f))
            elif f < self.min_fraction:
                out.append(Verdict(rank, REPAIR, f"only {f:.1%} arrived (< {self.min_fraction:.0%})", f))
            else:
                out.append(Verdict(rank, ACCEPT_LOSSY, f"{f:.1%} arrived over a lossy path", f,
                                   tuple(_bubbles_to_elements(rep.bubbles, n))))
        lossy = [v for v in out if v.action == ACCEPT_LOSSY]
        if lossy and _uncovered(n, out):
            out = [dataclasses.replace(v, action=REPAIR, reason=v.reason + "; some elements reached no accepted "
                                       "contribution") if v.action == ACCEPT_LOSSY else v for v in out]
        return out


def _tail_only(bubbles, total: int) -> bool:
    return len(bubbles) == 1 and int(bubbles[0][1]) >= total


def _bubbles_to_elements(bubbles, n: int) -> list:
    out = []
    for s, e in bubbles:
        lo = max(0, (int(s) - HDR) // ELEM)
        hi = min(n, -(-(int(e) - HDR) // ELEM))
        if hi > lo:
            out.append((lo, hi))
    return out


def _uncovered(n: int, verdicts: list) -> bool:
    """True if some element is delivered by no ACCEPT_* contribution."""
    accepted = [v for v in verdicts if v.action in (ACCEPT_FULL, ACCEPT_LOSSY)]
    if any(v.action == ACCEPT_FULL for v in accepted):
        return False
    if not accepted:
        return True
    miss = np.zeros(n + 1, np.int64)
    for v in accepted:
        for lo, hi in v.lost:
            miss[lo] += 1
            miss[hi] -= 1
    return bool((np.cumsum(miss[:n]) >= len(accepted)).any())


def mean_of(grads: list, losts: list, n: int, out: np.ndarray) -> None:
    """Per-element mean over the contributions that delivered each element (rank order; NaN propagates)."""
    out[:] = 0
    count = None
    for g, lost in zip(grads, losts):
        if lost:
            g = g.copy()
            if count is None:
                count = np.full(n + 1, 0, np.int64)
            for lo, hi in lost:
                g[lo:hi] = 0
                count[lo] += 1
                count[hi] -= 1
        out += g
    if count is None:
        out /= np.float32(len(grads))
    else:
        out /= (len(grads) - np.cumsum(count[:n])).astype(np.float32)


# --- counters and warnings ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class HookStats:
    """What the hook did, readable on every rank (``state.stats``)."""

    rounds: int = 0  # buckets averaged
    full_rounds: int = 0  # every contribution arrived whole on the first try
    lossy_rounds: int = 0  # some contribution used with holes (loss tolerance at work)
    repaired_rounds: int = 0  # some contribution had to be resent reliably
    repaired_contributions: int = 0
    cut_without_loss: int = 0  # contributions cut although only their tail was missing (Early Close on a clean path)
    resent_by_me: int = 0  # buckets this rank resent reliably
    errors: int = 0
    min_delivered_fraction: float = 1.0
    # highest loss rate this rank's own sends measured over LOSS_WINDOW transfers: the one counter that is per
    # rank (rank 0 hosts the bucket server, so its path is local and reads 0 with the PS hook)
    max_path_loss: float = 0.0
    reasons: dict = dataclasses.field(default_factory=dict)  # PS side (rank 0): repair reasons -> count

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class RateLimitedWarner:
    """``warnings.warn`` at most once per ``interval_s`` per key; says how many were suppressed."""

    def __init__(self, interval_s: float = WARN_INTERVAL_S, clock=time.monotonic):
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict = {}
        self._suppressed: dict = {}

    def warn(self, key: str, message: str) -> bool:
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        n = self._suppressed.pop(key, 0)
        self._last[key] = now
        extra = f" ({n} similar warnings suppressed in the last {self.interval_s:.0f} s)" if n else ""
        warnings.warn(f"ltp_ps.ddp: {message}{extra}", RuntimeWarning, stacklevel=2)
        return True


# --- threads, server, worker ----------------------------------------------------------------------------------


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
    """Aggregation-only PS for DDP buckets: gather round r from all ranks, decide, answer every rank."""

    def __init__(self, transport, peers: list, max_elems: int, *, min_fraction: float = MIN_FRACTION,
                 gather_timeout_s: float = 60.0):
        self.transport = transport
        self.peers = [tuple(p) for p in peers]
        self.world = len(self.peers)
        self.max_elems = max_elems
        self.policy = RoundPolicy(min_fraction)
        self.gather_timeout_s = gather_timeout_s
        self.bufs = [np.zeros(HDR + ELEM * max_elems, dtype=np.uint8) for _ in self.peers]
        self.out = np.zeros(reply_bytes(max_elems, self.world), dtype=np.uint8)
        self.round = 0
        self.delivered: list[list[float]] = []  # per round, every rank's delivered fraction (first try)
        self.verdicts: list[list[Verdict]] = []  # per round (bounded: the last HISTORY rounds)
        self.failed: BaseException | None = None
        self.reasons: dict = {}  # repair reasons -> count

    HISTORY = 1024

    async def serve_forever(self) -> None:
        while True:
            try:
                await self.serve_round()
            except Exception as exc:  # noqa: BLE001 - tell every rank, then stop serving
                self.failed = exc
                try:
                    await self._answer(ERROR, self.round - 1, -1, 0, kind=K_REPLY, strict=False,
                                       text=f"bucket server failed: {type(exc).__name__}: {exc}")
                    await self._answer(ERROR, self.round - 1, -1, 0, kind=K_FINAL, strict=False,
                                       text=f"bucket server failed: {type(exc).__name__}: {exc}")
                except Exception:  # noqa: BLE001 - the transport itself is gone; ranks time out with a cause
                    pass
                return

    async def _ready(self, rnd: int):
        """Every rank's READY note: (n elements, bucket index); -> ((n, index) or None, error text)."""
        notes = [np.zeros(READY_BYTES * 2, np.uint8) for _ in self.peers]
        ready = await gather_by_recv(self.transport, self.peers, notes, tag=hook_tag(rnd, K_READY),
                                     timeout=self.gather_timeout_s)
        got = {r: tuple(int(v) for v in nt.view(np.int64)) for r, (nt, rep) in enumerate(zip(notes, ready))
               if rep.received_bytes > 0}
        if not got:
            return None, ready, (f"no rank announced bucket round {rnd} within {self.gather_timeout_s:g} s "
                                 f"(every rank dead or stuck)")
        layouts = set(got.values())
        if len(layouts) > 1:
            return None, ready, f"ranks disagree on the bucket layout of round {rnd}: {got} (rank: (elements, bucket))"
        n, index = layouts.pop()
        if not 0 < n <= self.max_elems:
            return None, ready, f"round {rnd}: a bucket of {n} elements (the model has {self.max_elems})"
        return (n, index), ready, None

    async def _gather(self, rnd: int, n: int, ready: list, t0: float) -> list:
        """One Early Close gather over the ranks whose READY arrived (so Early Close judges transfers, not compute)."""
        bufs = [b[:HDR + ELEM * n] for b in self.bufs]
        tag = hook_tag(rnd, K_GRAD)
        reps = [missing_report(p, tag, b.nbytes, r.regime, time.monotonic() - t0)
                for p, b, r in zip(self.peers, bufs, ready)]
        idx = [i for i, r in enumerate(ready) if r.received_bytes > 0]
        left = max(0.001, self.gather_timeout_s - (time.monotonic() - t0))
        got = await self.transport.gather([self.peers[i] for i in idx], [bufs[i] for i in idx], tag=tag, timeout=left)
        for i, r in zip(idx, got):
            reps[i] = r
        return reps

    async def serve_round(self) -> None:
        rnd = self.round
        self.round += 1
        t0 = time.monotonic()
        layout, ready, err = await self._ready(rnd)
        if layout is None:
            await self._answer(ERROR, rnd, -1, 0, kind=K_REPLY, text=err, strict=False)
            return
        n, index = layout
        silent = [i for i, r in enumerate(ready) if r.received_bytes <= 0]
        if silent:
            # these ranks had the whole timeout to announce the round: they are dead or stuck, not lossy
            await self._answer(ERROR, rnd, index, n, kind=K_REPLY, strict=False,
                               text=f"rank(s) {silent} did not announce bucket {index} of round {rnd} within "
                                    f"{self.gather_timeout_s:g} s ({ready[silent[0]].regime}): dead or stuck")
            return
        reps = await self._gather(rnd, n, ready, t0)
        headers = [_unpack_grad(b) if r.received_bytes > 0 else None for b, r in zip(self.bufs, reps)]
        verdicts = self.policy.decide(rnd, n, reps, headers)
        self.delivered.append([float(r.delivered_fraction) for r in reps])
        self.verdicts.append(verdicts)
        del self.delivered[:-self.HISTORY], self.verdicts[:-self.HISTORY]
        repair = [v.rank for v in verdicts if v.action == REPAIR]
        for v in verdicts:
            if v.action == REPAIR:
                key = v.reason.split(" (")[0] if not v.reason.startswith(("cut at", "only")) else v.reason.split()[0]
                self.reasons[key] = self.reasons.get(key, 0) + 1
        summary = dict(lossy=sum(v.action == ACCEPT_LOSSY for v in verdicts), repaired=len(repair),
                       min_fraction=min(float(r.delivered_fraction) for r in reps),
                       cut=sum(v.reason.startswith("cut at") for v in verdicts))
        final_kind = K_REPLY
        if repair:
            mask = np.zeros(self.world, np.uint8)
            mask[repair] = 1
            await self._answer(RESEND, rnd, index, n, payload=mask, kind=K_REPLY, **summary)
            final_kind = K_FINAL
            got = await asyncio.gather(*(self._recv_repair(rnd, i, n) for i in repair))
            bad = [(i, e) for i, e in zip(repair, got) if e is not None]
            if bad:
                i, e = bad[0]
                await self._answer(ERROR, rnd, index, n, kind=final_kind, strict=False, **summary,
                                   text=f"rank {i}'s bucket {index} of round {rnd} did not arrive "
                                        f"({verdicts[i].reason}) and its reliable resend failed: {e} "
                                        f"(the rank is dead, stuck, or its network is down)")
                return
        grads, losts = [], []
        for v in verdicts:
            grads.append(self.bufs[v.rank][HDR:HDR + ELEM * n].view(np.float32))
            losts.append(list(v.lost) if v.action == ACCEPT_LOSSY else [])
        mean_of(grads, losts, n, self.out[HDR:HDR + ELEM * n].view(np.float32))
        await self._answer(RESULT, rnd, index, n, kind=final_kind, **summary)

    async def _recv_repair(self, rnd: int, rank: int, n: int):
        buf = self.bufs[rank][:HDR + ELEM * n]
        deadline = time.monotonic() + self.gather_timeout_s
        while True:
            try:
                rep = await self.transport.recv(buf, peer=self.peers[rank], tag=hook_tag(rnd, K_REPAIR),
                                                timeout=max(0.001, deadline - time.monotonic()))
            except Exception as exc:  # noqa: BLE001 - reported to every rank by the caller
                return f"{type(exc).__name__}: {exc}"
            if (rep.received_bytes >= buf.nbytes and not rep.bubbles) or time.monotonic() >= deadline:
                break  # else: closed early; the rank sends it again (LtpHookState._send_reliably)
        h = _unpack_grad(buf)
        if rep.received_bytes != buf.nbytes or h is None or h[1] != rnd or h[3] != n:
            return f"the resend carried {rep.received_bytes} bytes / header {h}, expected round {rnd}, {n} elements"
        return None

    async def _answer(self, status, rnd, index, n, *, kind, payload=None, text=None, lossy=0, repaired=0,
                      min_fraction=1.0, cut=0, strict=True) -> None:
        out = self.out
        out[:HDR] = 0
        _REPLY.pack_into(out, 0, REPLY_MAGIC, status, rnd, index, n, lossy, repaired, min_fraction, cut)
        size = reply_bytes(n, self.world)
        if payload is not None:
            out[HDR:HDR + payload.nbytes] = payload.view(np.uint8)
        if text is not None:
            b = text.encode()[:ERROR_TEXT_BYTES]
            out[HDR:HDR + ERROR_TEXT_BYTES] = 0
            out[HDR:HDR + len(b)] = np.frombuffer(b, np.uint8)
        view = memoryview(out)[:size]
        deadline = time.monotonic() + self.gather_timeout_s
        reps = await self.transport.broadcast(self.peers, view, tag=hook_tag(rnd, kind), timeout=self.gather_timeout_s)
        bad = [(p, r) for p, r in zip(self.peers, reps) if _undelivered(r)]
        for _ in range(SEND_ATTEMPTS - 1):
            # A transfer the transport gave up on (e.g. the peer was starved of CPU for a while) is sent again;
            # a duplicate answer is harmless (the rank takes the first one with this tag).
            if not bad or time.monotonic() >= deadline:
                break
            again = await asyncio.gather(*(self.transport.send(p, view, reliable=True, tag=hook_tag(rnd, kind),
                                                               timeout=max(0.001, deadline - time.monotonic()))
                                           for p, _ in bad), return_exceptions=True)
            bad = [(p, r) for (p, _), r in zip(bad, again) if _undelivered(r)]
        if bad and strict and status != ERROR:
            raise RemoteError(f"round {rnd}: could not deliver the answer to {bad[0][0]} in {SEND_ATTEMPTS} "
                              f"attempts: {bad[0][1]}")


def _undelivered(r) -> bool:
    """A broadcast outcome that did not reach the peer whole (an exception, or fewer bytes acknowledged)."""
    return isinstance(r, BaseException) or r.delivered_bytes < r.total_bytes


def _unpack_grad(buf):
    """(rank, round, bucket, n) of a gradient message, or None if the header is not one."""
    magic, rank, rnd, index, n, loss = _GRAD.unpack_from(buf, 0)
    if magic != GRAD_MAGIC:
        return None
    return rank, rnd, index, n, loss


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
    delivered: list = dataclasses.field(default_factory=list)  # this rank's send delivered fractions (bounded)
    stats: HookStats = dataclasses.field(default_factory=HookStats)
    warner: RateLimitedWarner = dataclasses.field(default_factory=RateLimitedWarner)
    server_task: object = None
    _losses: list = dataclasses.field(default_factory=list)  # (lost, sent) packets of recent transfers to the PS

    HISTORY = 1024

    async def _send_reliably(self, data, tag: int):
        """A reliable send to the PS, tried again (SEND_ATTEMPTS in all, within the timeout) if it fails."""
        deadline = time.monotonic() + self.timeout_s
        for attempt in range(SEND_ATTEMPTS):
            last = attempt == SEND_ATTEMPTS - 1 or time.monotonic() >= deadline
            try:
                rep = await self.transport.send(self.ps_addr, data, reliable=True, tag=tag,
                                                timeout=max(0.001, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - the last attempt's error is raised
                if last:
                    raise
                continue
            if rep.delivered_bytes >= rep.total_bytes or last:
                return rep

    def path_loss(self) -> float:
        """Lost / sent packets of this rank's last LOSS_WINDOW transfers to the PS (0 on TCP)."""
        sent = sum(s for _, s in self._losses)
        return sum(lo for lo, _ in self._losses) / sent if sent else 0.0

    def _note_loss(self, rep) -> None:
        raw = getattr(rep, "raw", None)
        lost, sent = getattr(raw, "lost_packets", 0), getattr(raw, "packets_sent", 0)
        if not sent and rep.total_bytes:  # transports without packet counters: the bytes that did not arrive
            lost, sent = rep.total_bytes - rep.delivered_bytes, rep.total_bytes
        if sent:
            self._losses.append((int(lost), int(sent)))
            del self._losses[:-LOSS_WINDOW]

    def _fail(self, r: int, index: int, cause: str) -> LtpBackendError:
        self.stats.errors += 1
        return LtpBackendError(f"ltp_ps.ddp: rank {self.rank}: bucket {index} round {r}: {cause}")

    async def exchange(self, r: int, index: int, grads: np.ndarray, critical: list) -> np.ndarray:
        n = grads.size
        msg = np.zeros(HDR + ELEM * n, dtype=np.uint8)
        loss = self.path_loss()
        self.stats.max_path_loss = max(self.stats.max_path_loss, loss)
        _GRAD.pack_into(msg, 0, GRAD_MAGIC, self.rank, r, index, n, loss)
        msg[HDR:].view(np.float32)[:] = grads
        note = np.zeros(READY_BYTES * 2, np.uint8)
        note.view(np.int64)[:] = (n, index)
        t = self.transport
        try:
            ready = self._send_reliably(note, hook_tag(r, K_READY))
            push = t.send(self.ps_addr, msg, reliable=False, critical=critical, element_size=ELEM,
                          tag=hook_tag(r, K_GRAD), timeout=self.timeout_s)
            _, rep = await asyncio.gather(ready, push)
        except Exception as exc:  # noqa: BLE001
            raise self._fail(r, index, f"sending to the bucket server at {self.ps_addr} failed: "
                                       f"{type(exc).__name__}: {exc}") from exc
        self.delivered.append(float(rep.delivered_fraction))
        del self.delivered[:-self.HISTORY]
        self._note_loss(rep)
        back = np.empty(reply_bytes(n, self.world_size), dtype=np.uint8)
        status, h = await self._reply(back, r, index, K_REPLY)
        if status == RESEND:
            if back[HDR + self.rank]:
                try:
                    self._note_loss(await self._send_reliably(msg, hook_tag(r, K_REPAIR)))
                except Exception as exc:  # noqa: BLE001
                    raise self._fail(r, index, f"reliable resend to the bucket server failed: "
                                               f"{type(exc).__name__}: {exc}") from exc
                self.stats.resent_by_me += 1
            status, h = await self._reply(back, r, index, K_FINAL)
            if status != RESEND:
                self._count(h, repaired=True)
        else:
            self._count(h, repaired=False)
        if status == ERROR:
            text = bytes(back[HDR:HDR + ERROR_TEXT_BYTES]).rstrip(b"\0").decode(errors="replace")
            raise self._fail(r, index, text)
        if status != RESULT or h[4] != n:
            raise self._fail(r, index, f"the bucket server answered {STATUS_NAMES.get(status, status)} with {h[4]} "
                                       f"elements (expected a result of {n}); ranks disagree on the bucket layout")
        return back[HDR:HDR + ELEM * n].view(np.float32)

    async def _reply(self, back, r, index, kind):
        # The PS may spend one timeout waiting for a silent rank's READY and one for a resend before it answers
        # with a named ERROR; wait longer than that so the named cause, not a bare timeout, reaches the user.
        wait = REPLY_WAIT_TIMEOUTS * self.timeout_s + REPLY_WAIT_SLACK_S
        deadline = time.monotonic() + wait
        while True:
            try:
                rep = await self.transport.recv(back, peer=self.ps_addr, tag=hook_tag(r, kind),
                                                timeout=max(0.001, deadline - time.monotonic()))
            except Exception as exc:  # noqa: BLE001
                cause = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, (TimeoutError, asyncio.TimeoutError)) or TIMEOUT in cause.lower():
                    cause = (f"no answer from the bucket server (rank 0 at {self.ps_addr}) within {wait:g} s: "
                             f"rank 0 or another rank is dead or stuck [{cause}]")
                raise self._fail(r, index, cause) from exc
            if rep.received_bytes >= rep.total_bytes and not rep.bubbles:
                break
            # a reliable answer the transport closed early: the PS sends it again (see BucketServer._answer)
        magic, status, rnd, _bidx, n, lossy, repaired, minf, cut = _REPLY.unpack_from(back, 0)
        if magic != REPLY_MAGIC or rnd != r:
            raise self._fail(r, index, f"malformed answer from the bucket server (round {rnd})")
        return status, (status, lossy, repaired, minf, n, cut)

    def _count(self, h, *, repaired: bool) -> None:
        status, lossy, n_rep, minf, _n, cut = h
        s = self.stats
        if status == ERROR:
            return
        s.rounds += 1
        s.min_delivered_fraction = min(s.min_delivered_fraction, minf)
        s.cut_without_loss += cut
        if repaired:
            s.repaired_rounds += 1
            s.repaired_contributions += n_rep
            self.warner.warn("repaired", f"{s.repaired_rounds} of {s.rounds} rounds needed a reliable resend of some "
                                         f"bucket ({s.cut_without_loss} contributions cut without loss so far); "
                                         f"see state.stats")
        elif lossy:
            s.lossy_rounds += 1
            self.warner.warn("lossy", f"{s.lossy_rounds} of {s.rounds} rounds averaged partially delivered buckets "
                                      f"(lowest delivered fraction {s.min_delivered_fraction:.1%}); see state.stats")
        else:
            s.full_rounds += 1

    def close(self) -> None:
        """Stop the bucket server (rank 0) and close the endpoints."""
        if self.server_task is not None:
            self.server_task.cancel()
        if self.transport is not None:
            self.runner.call(self.transport.close(), 10)
        if self.server is not None:
            self.runner.call(self.server.transport.close(), 10)
        self.runner.loop.call_soon_threadsafe(self.runner.loop.stop)


def ltp_hook(state: LtpHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket`` over all ranks through the PS."""
    buf = bucket.buffer()
    complete, fut = completion()
    if buf.dtype != torch.float32:
        complete(ConfigError(f"ltp_hook handles float32 buckets, got {buf.dtype}; train in float32 or cast "
                             "gradients"), failed=True)
        return fut
    grads = buf.detach().reshape(-1).numpy()
    ends, off = [], 0
    for p in bucket.parameters():
        ends += [(off, off + 1), (off + p.numel() - 1, off + p.numel())]
        off += p.numel()
    critical = limit_ranges([(0, HDR)] + [(HDR + ELEM * a, HDR + ELEM * b) for a, b in ends if b <= grads.size], 128)
    r = state.round
    state.round += 1
    cf = state.runner.submit(state.exchange(r, bucket.index(), grads, critical))

    def done(f):
        exc = f.exception()
        if exc is not None:
            complete(exc, failed=True)  # DDP raises it from backward(), message intact
        else:
            complete(torch.from_numpy(f.result().copy()).view_as(buf))

    cf.add_done_callback(done)
    return fut


# DDP checks the annotation object itself; ``from __future__ import annotations`` made it a string.
ltp_hook.__annotations__.update(bucket=dist.GradBucket, state=LtpHookState,
                                **{"return": torch.futures.Future[torch.Tensor]})


#: reduction schedules of the hook: ``direct`` = the bucket server on rank 0, the others PS-less (ddp_schedules)
SCHEDULES = ("direct", "ring", "rsgcm")
ENV_SCHEDULE = "LTP_DDP_SCHEDULE"


def default_schedule(world: int) -> str:
    """The ``auto`` rule: the bucket server (``direct``) for <= 2 ranks, a ``ring`` from 3 ranks on.

    With two ranks rank 0 receives one bucket per round either way; from three
    on, one process receiving ``world`` buckets is the bottleneck a ring does
    not have (each rank moves ``2 (world-1)/world`` of a bucket).
    """
    return "ring" if world > 2 else "direct"


def register(ddp_model, *, transport: str | None = None, cc: str = "cubic", min_fraction: float = MIN_FRACTION,
             host: str | None = None, timeout_s: float = 120.0, process_group=None,
             aggregation: str | None = None, schedule: str | None = None) -> LtpHookState:
    """Route ``ddp_model``'s gradient buckets over LTP; returns the hook state.

    ``schedule``: ``"direct"`` (a bucket server on rank 0, the round protocol
    above), ``"ring"`` or ``"rsgcm"`` (no server: a loss-tolerant ring
    all-reduce per bucket, :mod:`ltp_ps.ddp_schedules`), or ``"auto"`` / None
    (``$LTP_DDP_SCHEDULE``, else :func:`default_schedule`).
    ``min_fraction``: a lossy contribution that delivered less is resent
    reliably (1.0 = every bucket exact).  ``timeout_s``: how long a round may
    take before every rank's hook fails with a named cause.  ``aggregation``
    is accepted for compatibility; the mean is always the unbiased
    per-element mean.
    """
    if not dist.is_initialized():
        raise ConfigError("ltp_ps.ddp.register: call torch.distributed.init_process_group first")
    if aggregation not in (None, "unbiased"):
        raise ConfigError(f"ltp_ps.ddp.register: aggregation={aggregation!r} is not supported; the hook always "
                          "takes the unbiased per-element mean (pass min_fraction=1.0 for exact buckets)")
    RoundPolicy(min_fraction)  # validate early
    pg = process_group or dist.group.WORLD
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    schedule = schedule or os.environ.get(ENV_SCHEDULE, "auto")
    if schedule == "auto":
        schedule = default_schedule(world)
    if schedule not in SCHEDULES:
        raise ConfigError(f"ltp_ps.ddp.register: schedule={schedule!r} is unknown; use one of auto, "
                          f"{', '.join(SCHEDULES)} (or set {ENV_SCHEDULE})")
    kind = resolve_kind(transport or os.environ.get("LTP_PS_TRANSPORT", "auto"))
    host = host or os.environ.get("LTP_PS_HOST", "127.0.0.1")
    secret = os.environ.get("LTP_PS_SECRET", "").encode() or None
    store = dist.PrefixStore("ltp_ps_ddp/", dist.distributed_c10d._get_default_store())
    max_elems = sum(p.numel() for p in ddp_model.parameters() if p.requires_grad)
    if schedule != "direct":
        from . import collectives as C
        from .ddp_schedules import ScheduleHookState

        try:
            ring_plan = C.rsgcm_ring_plan(world) if schedule == "rsgcm" else None
        except Exception as exc:  # noqa: BLE001 - a planner failure names the fix
            raise ConfigError(f"ltp_ps.ddp.register: the rsgcm schedule could not plan {world} ranks "
                              f"({type(exc).__name__}: {exc}); use schedule='ring'") from exc
        state = ScheduleHookState(rank, world, kind, max_elems, timeout_s, runner=_LoopThread(f"ltp-ddp-{rank}"),
                                  schedule=schedule, min_fraction=min_fraction, ring_plan=ring_plan)
    else:
        state = LtpHookState(rank, world, kind, max_elems, timeout_s, runner=_LoopThread(f"ltp-ddp-{rank}"))

    async def open_ep():
        return await open_tolerant_transport(kind, host, cc=cc if kind == "tcp" else None, job_key=secret,
                                    advertise_host=os.environ.get("LTP_PS_ADVERTISE"))

    state.transport = state.runner.call(open_ep(), 30)
    store.set(f"addr/{rank}", f"{state.transport.local_addr[0]}:{state.transport.local_addr[1]}")
    if schedule != "direct":
        from .schedules.program import worker

        store.wait([f"addr/{r}" for r in range(world)])
        for r in range(world):
            h, _, p = store.get(f"addr/{r}").decode().rpartition(":")
            state.nodes[worker(r)] = (h, int(p))
        if rank == 0:
            print(f"ltp_ps.ddp: gradient buckets of {world} ranks all-reduced by a {schedule} schedule over {kind}"
                  f"{'/' + cc if kind == 'tcp' else ''} (loss-tolerant reduce-scatter; rounds below "
                  f"{min_fraction:.0%} are reduced again reliably)", flush=True)
        ddp_model.register_comm_hook(state, ltp_hook)
        return state
    if rank == 0:
        ps_t = state.runner.call(open_ep(), 30)
        store.wait([f"addr/{r}" for r in range(world)])
        peers = []
        for r in range(world):
            h, _, p = store.get(f"addr/{r}").decode().rpartition(":")
            peers.append((h, int(p)))
        state.server = BucketServer(ps_t, peers, max_elems, min_fraction=min_fraction, gather_timeout_s=timeout_s)
        state.server.reasons = state.stats.reasons  # rank 0's stats show why contributions were repaired
        state.server_task = state.runner.submit(state.server.serve_forever())
        store.set("ps", f"{ps_t.local_addr[0]}:{ps_t.local_addr[1]}")
        print(f"ltp_ps.ddp: gradient buckets of {world} ranks averaged by a PS at {ps_t.local_addr} over "
              f"{kind}{'/' + cc if kind == 'tcp' else ''} (lossy contributions below {min_fraction:.0%} or cut "
              f"without loss are resent reliably)", flush=True)
    store.wait(["ps"])
    h, _, p = store.get("ps").decode().rpartition(":")
    state.ps_addr = (h, int(p))
    ddp_model.register_comm_hook(state, ltp_hook)
    return state
