"""Parameter server on LTP (installed as ``ltp_ps``).

Layers, as in ps-lite: transport (:mod:`ltp_ps.transport`: LTP, TCP, in-memory)
-> membership/rendezvous through torch's TCPStore (:mod:`ltp_ps.rendezvous`,
:mod:`ltp_ps.membership`) -> request tracking (asyncio awaitables returning
reports) -> push/pull (:class:`Worker`, :class:`ParameterServer`).  The
communication pattern is a pluggable :class:`Schedule`; aggregation,
schedules, membership, staleness and error feedback are sans-IO objects.

Importing this package registers the ``torch.distributed`` backend ``ltp``
(:mod:`ltp_ps.backend`): ``dist.init_process_group("ltp")``.

Entry points: ``ltp-ps`` (:mod:`ltp_ps.cli`), ``python -m ltp_ps.run`` under
torchrun, and the DDP hook :func:`ltp_ps.ddp.register`.  See ``docs/ps.md``.
"""

from . import backend as _backend
from .aggregate import Aggregator, bubbles_to_elements, critical_ranges
from .errors import (AuthError, ConfigError, MembershipError, PSError, RemoteError, RendezvousError, TransportError,
                     TransportTimeout)
from .feedback import ErrorFeedback
from .membership import Membership, Staleness
from .optim import FlatOptimizer
from .schedule import DirectSchedule, Schedule
from .server import ParameterServer, ServerConfig
from .sharding import ShardPlan
from .worker import ShardRef, Worker, WorkerConfig

__all__ = ["Aggregator", "AuthError", "ConfigError", "DirectSchedule", "ErrorFeedback", "FlatOptimizer",
           "Membership", "MembershipError", "PSError", "ParameterServer", "RemoteError", "RendezvousError",
           "Schedule", "ServerConfig", "ShardPlan", "ShardRef", "Staleness", "TransportError", "TransportTimeout",
           "Worker", "WorkerConfig", "bubbles_to_elements", "critical_ranges"]

_backend.register()
