"""LTP: a loss-tolerant transport over UDP for distributed training.

The protocol core is sans-IO (:mod:`ltp.engine` and the modules it uses);
:mod:`ltp.endpoint` is the asyncio adapter and :class:`ltp.Socket` a blocking
wrapper. See docs/api.md and docs/protocol.md.

Public names are loaded on first use (PEP 562), so importing a leaf module
such as :mod:`ltp.errors` from the compiled extensions never drags in the
whole package (and never forms an import cycle).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "Config": "config", "DCN": "config", "WAN": "config",
    "Endpoint": "endpoint", "open_endpoint": "endpoint",
    "Socket": "blocking",
    "SendReport": "reports", "RecvReport": "reports", "EndpointStats": "reports",
    "LTPError": "errors", "LocalProtocolError": "errors", "RemoteProtocolError": "errors", "WireError": "errors",
    "TransferRefused": "errors", "TransferTimeout": "errors", "TransferAborted": "errors",
    "PeerUnreachable": "errors", "BroadcastError": "errors",
}

__all__ = sorted(_EXPORTS) + ["run", "using_extensions"]


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'ltp' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ltp.{mod}"), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__


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

    for name in ("wire", "datapath", "udpio"):
        if name not in ltp_ext.loaded:
            ltp_ext.load(name)
    return dict(ltp_ext.loaded)
