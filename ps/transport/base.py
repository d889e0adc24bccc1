"""The transport interface the parameter server is written against.

Theory of operation
-------------------
A transport moves *messages*: one contiguous buffer from one peer to another,
labelled with an integer ``tag``.  It mirrors the LTP endpoint API
(``docs/api.md``) so that the PS code never depends on which transport runs
underneath:

* ``send(peer, data, reliable=..., critical=..., tag=...)`` -> :class:`SendReport`
* ``recv(into, peer=None, tag=None)`` -> :class:`RecvReport`
* ``gather(peers, into, tag=...)`` -> one :class:`RecvReport` per peer, in order;
  a peer that delivered nothing before the deadline has ``regime="timeout"`` and
  ``delivered_fraction == 0`` instead of raising, so one dead worker never
  stalls the others.
* ``broadcast(peers, data, tag=...)`` -> one :class:`SendReport` *or the
  exception* per peer (reliable, bit-exact).

Reports are our own frozen dataclasses (the LTP adapter converts ``ltp``'s
reports), so the PS keeps working if ``ltp`` adds fields.  ``bubbles`` are
half-open **byte** ranges of the receive buffer that were zero-filled because
their packets were not delivered; reliable transports report none.

Peers are addressed by ``(host, port)``: the address a transport listens on
(``local_addr``), which is what workers publish in the rendezvous store.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Sequence, Union

from ltp.regimes import CloseReason, Regime

Address = tuple  # (host: str, port: int)
ByteRange = tuple  # (start, end), half-open, bytes

# Regimes: the members of ltp.regimes.Regime (ltp.RecvReport.regime), named once for ltp and the PS.
COMPLETE = Regime.COMPLETE
EARLY = Regime.EARLY
DEADLINE = Regime.DEADLINE
CANCELLED = Regime.CANCELLED
TIMEOUT = Regime.TIMEOUT


@dataclasses.dataclass(frozen=True)
class RecvReport:
    """What arrived from one peer for one message."""

    peer: Address
    tag: int
    total_bytes: int
    received_bytes: int
    delivered_fraction: float
    bubbles: tuple = ()  # ((start, end), ...) zero-filled byte ranges
    critical_complete: bool = True
    regime: str = COMPLETE
    duration_s: float = 0.0  # seconds
    raw: object = dataclasses.field(default=None, compare=False, repr=False)
    #: nothing came because the sender is gone (its connection closed, it is unreachable), not merely late
    peer_gone: bool = False

    @property
    def ok(self) -> bool:
        """True if anything usable arrived (critical ranges included)."""
        return self.received_bytes > 0 and self.critical_complete and self.regime != TIMEOUT

    @property
    def complete(self) -> bool:
        """True if the whole message arrived (what a reliable receive must deliver to count)."""
        return (self.regime == COMPLETE and not self.bubbles and self.critical_complete
                and 0 < self.total_bytes <= self.received_bytes)


@dataclasses.dataclass(frozen=True)
class SendReport:
    """What the sender knows about one message it sent."""

    peer: Address
    tag: int
    total_bytes: int
    delivered_bytes: int
    delivered_fraction: float
    duration_s: float = 0.0  # seconds
    close_reason: str = CloseReason.COMPLETE
    reliable: bool = True
    raw: object = dataclasses.field(default=None, compare=False, repr=False)


def missing_report(peer: Address, tag: int, total_bytes: int, regime: str = TIMEOUT,
                   duration_s: float = 0.0, *, peer_gone: bool = False) -> RecvReport:
    """The report of a peer that delivered nothing (dead, dropped, late; ``peer_gone``: known to be gone)."""
    return RecvReport(peer=peer, tag=tag, total_bytes=total_bytes, received_bytes=0,
                      delivered_fraction=0.0, bubbles=((0, total_bytes),) if total_bytes else (),
                      critical_complete=False, regime=regime, duration_s=duration_s, peer_gone=peer_gone)


class Transport(abc.ABC):
    """One endpoint.  Subclasses: TcpTransport, LtpTransport, MemoryTransport."""

    name: str = "abstract"
    #: a completed send is evidence that the peer's *process* is alive: LTP's ACKs come from the peer's engine,
    #: and the in-memory transport holds a send to a stalled peer.  Kernel TCP completes a send into the socket
    #: buffers of a paused (SIGSTOP) or hung peer, so there only what comes *from* a peer proves it is alive
    sends_confirm_peer: bool = True

    @property
    @abc.abstractmethod
    def local_addr(self) -> Address:
        """The ``(host, port)`` peers use to reach this endpoint."""

    @abc.abstractmethod
    async def send(self, peer: Address, data, *, reliable: bool = False,
                   critical: Sequence[ByteRange] = (), element_size: int = 4,
                   tag: int = 0, timeout: float | None = None) -> SendReport:
        """Send one message to ``peer``."""

    @abc.abstractmethod
    async def recv(self, into, *, peer: Address | None = None, tag: int | None = None,
                   timeout: float | None = None) -> RecvReport:
        """Receive one message into the writable buffer ``into``."""

    @abc.abstractmethod
    async def gather(self, peers: Sequence[Address], into: Sequence, *, tag: int,
                     timeout: float | None = None, clock: str = "first") -> list[RecvReport]:
        """One message from each peer (same tag) into the matching buffer.

        ``clock``: where a loss-tolerant transport's Early Close clock starts, ``"first"`` registration or
        ``"all"`` registered (``ltp.early_close.GroupClock``); a transport without Early Close waits for every
        message up to ``timeout`` either way."""

    async def broadcast(self, peers: Sequence[Address], data, *, tag: int,
                        timeout: float | None = None) -> list[Union[SendReport, BaseException]]:
        """Reliably send ``data`` to every peer; one report or exception per peer."""
        import asyncio

        return list(await asyncio.gather(
            *(self.send(p, data, reliable=True, tag=tag, timeout=timeout) for p in peers),
            return_exceptions=True))

    async def expect(self, peer: Address, into, *, tag: int) -> None:
        """A hint: the message ``tag`` from ``peer`` will be received into ``into`` by a later recv/gather.

        A transport that can use it (LTP) writes that message into ``into`` if it arrives before the receive
        is posted, so the receive copies nothing; from now until that receive completes ``into`` belongs to
        the transport. Transports that cannot use it ignore it (this default)."""

    def discard_before(self, tag: int) -> int:
        """Forget buffered messages with a smaller tag (late gradients of closed rounds)."""
        box = getattr(self, "_mailbox", None)
        return box.discard_before(tag) if box is not None else 0

    @abc.abstractmethod
    async def close(self) -> None:
        """Abort open transfers and release sockets."""

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


def as_bytes_view(buf) -> memoryview:
    """A flat, byte-format memoryview of any C-contiguous buffer (numpy, torch, bytes)."""
    try:
        import torch

        if isinstance(buf, torch.Tensor):
            buf = buf.detach().numpy()
    except ImportError:  # pragma: no cover - torch is a dependency of ltp_ps
        pass
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise ValueError("transport buffers must be C-contiguous; call .contiguous() / np.ascontiguousarray first")
    return mv.cast("B")


async def gather_by_recv(transport: Transport, peers: Sequence[Address], into: Sequence, *,
                         tag: int, timeout: float | None) -> list[RecvReport]:
    """``gather`` for transports without a native one: parallel receives, one deadline.

    A peer that fails (closed connection) or misses the deadline gets a
    :func:`missing_report` (``regime="cancelled"`` or ``"timeout"``) instead of an
    exception, so the caller always gets one report per peer.
    """
    import asyncio
    import time

    if len(peers) != len(into):
        raise ValueError(f"gather: {len(peers)} peers but {len(into)} buffers; pass one buffer per peer")
    t0 = time.monotonic()

    async def one(peer, buf):
        try:
            return await transport.recv(buf, peer=peer, tag=tag, timeout=timeout)
        except (TimeoutError, asyncio.TimeoutError):
            return missing_report(peer, tag, as_bytes_view(buf).nbytes, TIMEOUT, time.monotonic() - t0)
        except (ConnectionError, OSError) as exc:  # peer went away
            del exc
            return missing_report(peer, tag, as_bytes_view(buf).nbytes, CANCELLED, time.monotonic() - t0)

    return list(await asyncio.gather(*(one(p, b) for p, b in zip(peers, into))))
