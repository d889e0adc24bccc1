"""LTP: a loss-tolerant transport over UDP for distributed training.

The protocol core is sans-IO (:mod:`ltp.engine` and the modules it uses);
:mod:`ltp.endpoint` is the asyncio adapter and :class:`ltp.Socket` a blocking
wrapper. See docs/api.md and docs/protocol.md.
"""

from __future__ import annotations

from .blocking import Socket
from .config import DCN, WAN, Config
from .endpoint import Endpoint, open_endpoint
from .errors import (LocalProtocolError, LTPError, RemoteProtocolError, TransferAborted, TransferRefused,
                     TransferTimeout, WireError)
from .reports import EndpointStats, RecvReport, SendReport

__version__ = "0.1.0"

__all__ = [
    "Config", "DCN", "WAN", "Endpoint", "open_endpoint", "Socket", "run", "SendReport", "RecvReport",
    "EndpointStats", "LTPError", "LocalProtocolError", "RemoteProtocolError", "WireError", "TransferRefused",
    "TransferTimeout", "TransferAborted", "using_extensions",
]


def run(coro):
    """Run ``coro`` to completion on uvloop when it is installed, else on asyncio's default loop."""
    import asyncio

    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def using_extensions() -> dict:
    """Which ``ltp_ext`` modules are compiled (True) or pure-Python twins (False)."""
    import ltp_ext

    return dict(ltp_ext.loaded)
