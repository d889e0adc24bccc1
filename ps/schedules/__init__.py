"""Aggregation schedules: the sans-IO round plans, their data model, and the registry.

Layer (see ``docs/schedules.md``):

* :mod:`.program`   steps, programs, round plans, the dynamic-controller interface;
* :mod:`.topology`  hosts, racks, rates, latencies, failed pairs;
* :mod:`.tags`      structured message tags ``(iteration, phase, step, chunk, kind)``;
* :mod:`.partial`   mergeable partial aggregates (sum + per-element counts);
* planners (``direct``, ``ring``, ...) compile into programs; one executor runs them.
"""

from __future__ import annotations

from .base import LinkReport, Schedule, World
from .partial import Partial
from .program import (APPLY_AT_SERVER, APPLY_AT_WORKERS, Adopt, Apply, Combine, Controller, Forward, Grant, Program,
                      Recv, RoundPlan, Send, server, worker)
from .tags import Tag
from .registry import available, availability, create, schedule_class
from .topology import HostLink, Topology, Uplink

__all__ = ["Partial", "Tag", "Topology", "HostLink", "Uplink", "Program", "RoundPlan", "Send", "Recv", "Combine",
           "Apply", "Forward", "Adopt", "Grant", "Controller", "APPLY_AT_SERVER", "APPLY_AT_WORKERS", "server",
           "worker", "World", "Schedule", "LinkReport", "available", "availability", "create", "schedule_class"]
