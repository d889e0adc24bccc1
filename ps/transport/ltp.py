"""The LTP transport: the ``ltp`` endpoint API (``docs/api.md``) behind :class:`Transport`.

Gradients go out with ``reliable=False`` and the PS's critical ranges (header
plus the first and last element of every tensor); the PS collects them with
``ep.gather`` so one Early Close deadline covers the whole incast; parameters
go back with ``ep.broadcast`` (reliable, bit-exact).  ``ltp``'s reports are
converted to ours, keeping the original in ``.raw``; ``bubbles``,
``regime`` and ``delivered_fraction`` pass through unchanged.
"""

from __future__ import annotations

import asyncio
import time
from typing import Sequence

from ..errors import ConfigError, PeerGone, TransportError, TransportTimeout
from .base import (CANCELLED, TIMEOUT, Address, RecvReport, SendReport, Transport, as_bytes_view,
                   missing_report)


def _import_ltp():
    try:
        import ltp
    except ImportError as exc:  # pragma: no cover - ltp is part of this repository
        raise ConfigError(f"cannot import ltp ({exc}); install this repository with `pip install -e .`") from exc
    if not hasattr(ltp, "open_endpoint"):
        raise ConfigError("ltp.open_endpoint is missing: this ltp build does not implement docs/api.md yet; "
                          "use --transport tcp until it does")
    return ltp


def _recv_report(r) -> RecvReport:
    return RecvReport(peer=tuple(r.peer) if r.peer is not None else None, tag=r.tag,
                      total_bytes=r.total_bytes, received_bytes=r.received_bytes,
                      delivered_fraction=float(r.delivered_fraction),
                      bubbles=tuple((int(s), int(e)) for s, e in r.bubbles),
                      critical_complete=bool(r.critical_complete), regime=r.regime,
                      duration_s=float(r.duration_s), raw=r)


def _send_report(r) -> SendReport:
    return SendReport(peer=tuple(r.peer), tag=r.tag, total_bytes=r.total_bytes,
                      delivered_bytes=r.delivered_bytes, delivered_fraction=float(r.delivered_fraction),
                      duration_s=float(r.duration_s), close_reason=r.close_reason,
                      reliable=bool(r.reliable), raw=r)


BACKPRESSURE_REFUSALS = ("out_of_memory", "too_many_flows")  # the receiver is full for now: try again later
REFUSED_RETRY_S = 0.02  # seconds before the first retry of a refused send (doubling)
REFUSED_RETRY_MAX_S = 0.5  # seconds between retries at most


class LtpTransport(Transport):
    """Create with ``await LtpTransport.open(host, port, job_key=...)``."""

    name = "ltp"

    def __init__(self, ep, ltp_mod, advertise_host: str | None):
        self.refused_retries = 0  # sends tried again after a back-pressure refusal
        self._ep = ep
        self._ltp = ltp_mod
        host, port = ep.local_addr[:2]
        if advertise_host:
            host = advertise_host
        elif host in ("0.0.0.0", ""):
            host = "127.0.0.1"
        self._addr = (host, port)

    @classmethod
    async def open(cls, host: str = "127.0.0.1", port: int = 0, *, job_key: bytes | None = None,
                   advertise_host: str | None = None, rng=None, config_kwargs: dict | None = None):
        ltp = _import_ltp()
        kw = dict(config_kwargs or {})
        if job_key is not None:
            kw["job_key"] = job_key
        cfg = ltp.Config(**kw)
        ep = await ltp.open_endpoint((host, port), config=cfg, rng=rng)
        return cls(ep, ltp, advertise_host)

    @property
    def local_addr(self) -> Address:
        return self._addr

    @property
    def stats(self):
        return self._ep.stats

    def _wrap(self, exc: BaseException, what: str) -> BaseException:
        errors = self._ltp.errors
        if isinstance(exc, errors.LocalProtocolError):
            return exc
        if isinstance(exc, errors.TransferTimeout):
            return TransportTimeout(f"{what}: {exc}")
        if isinstance(exc, errors.PeerUnreachable):
            return PeerGone(f"{what}: {exc}")
        if isinstance(exc, errors.LTPError):
            return TransportError(f"{what}: {exc}")
        return exc

    async def send(self, peer, data, *, reliable=False, critical=(), element_size=4, tag=0, timeout=None):
        """``ep.send``; a registration the receiver refuses for want of room (``BACKPRESSURE_REFUSALS``: it holds
        messages nobody has received yet) is tried again, backing off, until ``timeout`` -- back-pressure,
        as a full TCP window would give -- instead of failing the transfer (a PS still broadcasting has not
        posted its gather when the first workers push)."""
        t0 = time.monotonic()
        wait = REFUSED_RETRY_S
        while True:
            left = None if timeout is None else timeout - (time.monotonic() - t0)
            try:
                r = await self._ep.send(tuple(peer), as_bytes_view(data), reliable=reliable,
                                        critical=[tuple(c) for c in critical], element_size=element_size,
                                        tag=tag, timeout=left)
            except self._ltp.errors.LTPError as exc:  # TransferRefused carries ``reason``
                if getattr(exc, "reason", None) not in BACKPRESSURE_REFUSALS or (left is not None and left <= wait):
                    raise self._wrap(exc, f"send to {peer}") from exc
                self.refused_retries += 1
                await asyncio.sleep(wait)
                wait = min(REFUSED_RETRY_MAX_S, 2 * wait)
                continue
            return _send_report(r)

    async def recv(self, into, *, peer=None, tag=None, timeout=None):
        try:
            r = await self._ep.recv(into=as_bytes_view(into), peer=None if peer is None else tuple(peer),
                                    tag=tag, timeout=timeout)
        except self._ltp.errors.LTPError as exc:
            raise self._wrap(exc, f"recv from {peer}") from exc
        return _recv_report(r)

    async def gather(self, peers: Sequence[Address], into: Sequence, *, tag, timeout=None, clock="first"):
        t0 = time.monotonic()
        peers = [tuple(p) for p in peers]
        views = [as_bytes_view(b) for b in into]
        try:
            reps = await self._ep.gather(peers, into=views, tag=tag, timeout=timeout, clock=clock)
        except self._ltp.errors.TransferTimeout:
            return [missing_report(p, tag, v.nbytes, TIMEOUT, time.monotonic() - t0) for p, v in zip(peers, views)]
        except self._ltp.errors.LTPError:
            return [missing_report(p, tag, v.nbytes, CANCELLED, time.monotonic() - t0) for p, v in zip(peers, views)]
        return [_recv_report(r) for r in reps]

    async def expect(self, peer, into, *, tag):
        """``ep.expect``: an early gradient lands in ``into`` itself, not in a buffer the gather then copies."""
        try:
            await self._ep.expect(tuple(peer), as_bytes_view(into), tag=tag)
        except self._ltp.errors.LTPError as exc:
            raise self._wrap(exc, f"expect from {peer}") from exc

    async def broadcast(self, peers, data, *, tag, timeout=None):
        """One reliable send per peer, concurrently, under one ``timeout``; a report or an exception per peer.

        Each peer goes through :meth:`send` (not ``Endpoint.broadcast``) so that a send refused for
        back-pressure (``out_of_memory``, ``too_many_flows``) is retried per peer within the timeout."""
        view = as_bytes_view(data)
        return list(await asyncio.gather(
            *(self.send(tuple(p), view, reliable=True, tag=tag, timeout=timeout) for p in peers),
            return_exceptions=True))

    async def close(self):
        await self._ep.close()
