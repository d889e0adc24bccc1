"""Parameter server on LTP (installed as ``ltp_ps``).

Layers, as in ps-lite: transport (:mod:`ltp_ps.transport`: LTP, TCP, in-memory)
-> membership/rendezvous through torch's TCPStore (:mod:`ltp_ps.rendezvous`,
:mod:`ltp_ps.membership`) -> request tracking (asyncio awaitables returning
reports) -> push/pull (:class:`Worker`, :class:`ParameterServer`).  The
communication pattern is a pluggable :class:`Schedule`; aggregation,
schedules, membership, staleness and error feedback are sans-IO objects.

Importing this package registers the ``torch.distributed`` backend ``ltp``
(:mod:`ltp_ps.backend`): ``dist.init_process_group("ltp")``. It does not import
torch for that when it need not: the classes below load on first use (PEP 562),
and the backend is registered at once if torch is imported, else by torch's own
extension autoload when it is (:mod:`ltp_ps.torch_plugin`). So a process that
never trains (``ltp-ps launch``, a config error) does not pay torch's import.

Entry points: ``ltp-ps`` (:mod:`ltp_ps.cli`), ``python -m ltp_ps.run`` under
torchrun, and the DDP hook :func:`ltp_ps.ddp.register`.  See ``docs/ps.md``.
"""

from __future__ import annotations

import importlib
import sys

from . import torch_plugin
from .errors import (AuthError, ConfigError, MembershipError, PSError, RemoteError, RendezvousError, TransportError,
                     TransportTimeout)

#: public names defined in submodules that import torch, with their module: loaded on first use
_LAZY = {
    "Aggregator": "aggregate", "bubbles_to_elements": "aggregate", "critical_ranges": "aggregate",
    "ErrorFeedback": "feedback", "Membership": "membership", "Staleness": "membership", "FlatOptimizer": "optim",
    "DirectSchedule": "schedule", "Schedule": "schedule", "ParameterServer": "server", "ServerConfig": "server",
    "ShardPlan": "sharding", "ShardRef": "worker", "Worker": "worker", "WorkerConfig": "worker",
}

__all__ = ["Aggregator", "AuthError", "ConfigError", "DirectSchedule", "ErrorFeedback", "FlatOptimizer",
           "Membership", "MembershipError", "PSError", "ParameterServer", "RemoteError", "RendezvousError",
           "Schedule", "ServerConfig", "ShardPlan", "ShardRef", "Staleness", "TransportError", "TransportTimeout",
           "Worker", "WorkerConfig", "bubbles_to_elements", "critical_ranges"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


# torch imported (or being imported: its autoload may be what imports us): register now. Not imported: torch's
# autoload will call the entry point when it is; without that entry point (a source tree on PYTHONPATH, or
# TORCH_DEVICE_BACKEND_AUTOLOAD=0) import torch here, as this package always did, so the promise above holds.
if "torch" in sys.modules or not torch_plugin.autoload_installed():
    torch_plugin.register()
