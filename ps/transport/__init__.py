"""Transports behind one interface: TCP (kernel CC), LTP, and an in-memory fake."""

from __future__ import annotations

from .base import (CANCELLED, COMPLETE, DEADLINE, EARLY, TIMEOUT, Address, RecvReport, SendReport,
                   Transport, missing_report)
from .memory import MemoryNetwork, MemoryTransport
from .tcp import TcpTransport, available_congestion_controls

__all__ = ["Address", "RecvReport", "SendReport", "Transport", "TcpTransport", "LtpTransport",
           "MemoryNetwork", "MemoryTransport", "open_transport", "missing_report",
           "available_congestion_controls", "resolve_kind", "COMPLETE", "EARLY", "DEADLINE", "CANCELLED", "TIMEOUT"]


def __getattr__(name):
    if name == "LtpTransport":
        from .ltp import LtpTransport

        return LtpTransport
    raise AttributeError(name)


def resolve_kind(kind: str) -> str:
    """``"auto"`` -> ``"ltp"`` when ``ltp.open_endpoint`` exists, else ``"tcp"``; other names unchanged."""
    if kind != "auto":
        return kind
    try:
        import ltp
    except ImportError:
        return "tcp"
    return "ltp" if hasattr(ltp, "open_endpoint") else "tcp"


PEER_SILENCE_MIN_S = 5.0  # seconds of silence before an LTP send declares its peer dead (ltp's floor is 1 s): a
#                           worker copying or allocating hundreds of MB for a second is alive; killed processes are
#                           still found at once (ICMP unreachable)


async def open_transport(kind: str, host: str = "127.0.0.1", port: int = 0, *, cc: str | None = "cubic",
                         job_key: bytes | None = None, advertise_host: str | None = None,
                         link_rate_bps: float | None = None, inbound_only: bool = False) -> Transport:
    """Open a ``"tcp"`` or ``"ltp"`` endpoint listening on ``(host, port)``.

    ``link_rate_bps``: this host's link rate in bit/s (LTP only: its receivers grant each sender an equal share
    and its sends split it, ``ltp/link_share.py``; kernel TCP has no use for it); ``inbound_only``: only the
    inbound side runs at that rate (grants, no split of the sends: ``Config.share_egress`` False)."""
    if kind == "tcp":
        return await TcpTransport.open(host, port, cc=cc, advertise_host=advertise_host)
    if kind == "ltp":
        from .ltp import LtpTransport

        kw = {"peer_silence_min_s": PEER_SILENCE_MIN_S}
        if link_rate_bps is not None:
            kw["link_rate"] = link_rate_bps / 8
            kw["share_egress"] = not inbound_only
        return await LtpTransport.open(host, port, job_key=job_key, advertise_host=advertise_host, config_kwargs=kw)
    from ..errors import ConfigError

    raise ConfigError(f"unknown transport {kind!r}; use --transport ltp or --transport tcp")
