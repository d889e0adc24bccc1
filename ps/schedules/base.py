"""The schedule interface: a planner constructed with its world yields one round plan per round.

Theory of operation
-------------------
A :class:`Schedule` is a sans-IO planner.  It is built once per process with
the :class:`World` (its own node id, the workers and PS shards with their
model ranges and addresses, the topology, the model's tensor layout) and asked
``plan(iteration)`` for a :class:`~ltp_ps.schedules.program.RoundPlan` every
round.  ``observe(reports)`` feeds it what the last round measured (per-link
rates, failures) so adaptive planners (RSGCM, MLfabric) can replan; static
ones ignore it.  Every process of a job builds the same schedule from the same
world, so all of them derive the same plan; a planner that uses randomness
takes a seeded ``random.Random`` and, where processes could diverge (measured
inputs), the coordinator distributes the plan (``RoundPlan.to_json``).

``apply_at`` says who runs the optimizer: the PS (``"server"``: direct,
MLfabric, trees) or every worker on the reduced gradient (``"workers"``:
rings, which run with zero PS processes).  ``controller()`` returns a
:class:`~ltp_ps.schedules.program.Controller` for schedules whose steps are
decided at run time (Hoplite, MLfabric), else ``None``.
"""

from __future__ import annotations

import abc
import dataclasses
import random
from typing import Mapping, Sequence

from .program import APPLY_AT_SERVER, Controller, RoundPlan, server, worker
from .topology import Topology


@dataclasses.dataclass(frozen=True)
class LinkReport:
    """What one transfer of a past round measured (for adaptive planners)."""

    src: str
    dst: str
    nbytes: int
    duration_s: float  # seconds
    delivered_fraction: float = 1.0
    rtprop_s: float = 0.0  # seconds (LTP's path estimate; 0 = unknown)
    btlbw_bps: float = 0.0  # bit/s (LTP's path estimate; 0 = unknown)
    ok: bool = True  # False: the peer did not answer (failed link or node)


@dataclasses.dataclass(frozen=True)
class World:
    """Everything a schedule may plan with.  Plain data; the same on every process of a job."""

    workers: tuple  # worker ranks in the job (sorted)
    n_elems: int  # model size in float32 elements
    shards: tuple = ()  # ((lo, hi), ...) per PS shard; () for schedules with no PS (rings)
    me: str | None = None  # this process's node id (None: a planner-only view, e.g. ``ltp-ps plan``)
    addresses: Mapping = dataclasses.field(default_factory=dict)  # node -> (host, port)
    topology: Topology | None = None
    placement: Mapping = dataclasses.field(default_factory=dict)  # node -> topology host name
    layout: tuple = ()  # ((offset, numel), ...) tensors of the flat model (critical ranges)
    link_reports: tuple = ()  # LinkReport of past rounds
    aggregation: str = "unbiased"

    def __post_init__(self):
        object.__setattr__(self, "workers", tuple(sorted(int(w) for w in self.workers)))
        object.__setattr__(self, "shards", tuple(tuple(s) for s in self.shards))
        if not self.workers:
            raise ValueError("a world needs at least one worker")
        if self.n_elems < 0:
            raise ValueError("n_elems must be >= 0")

    @property
    def worker_nodes(self) -> list[str]:
        return [worker(r) for r in self.workers]

    @property
    def server_nodes(self) -> list[str]:
        return [server(s) for s in range(len(self.shards))]

    def host_of(self, node: str) -> str:
        """The topology host of ``node``: explicit placement, a host named like the node, or launch order.

        Launch order is ``ltp-ps launch``'s: PS shards on the first hosts,
        then workers by rank.  A topology with exactly one host per worker
        (no room for the PS) colocates: worker r on host r, shard k on worker
        k's host.
        """
        if node in self.placement:
            return self.placement[node]
        if self.topology is None:
            return node
        names = self.topology.names
        if node in names:
            return node
        order = self.server_nodes + self.worker_nodes
        if len(names) == len(self.workers) < len(order):
            # one host per worker and no room for the PS: the shards are colocated, shard k on
            # worker k's host (issue 11's --colocate choice; what `ltp-lab schedules` runs)
            if node in self.worker_nodes:
                return names[self.worker_nodes.index(node)]
            if node in self.server_nodes:
                return names[self.server_nodes.index(node) % len(names)]
        i = order.index(node) if node in order else -1
        if 0 <= i < len(names):
            return names[i]
        raise KeyError(f"node {node} has no host in the topology ({len(names)} hosts for {len(order)} nodes); "
                       f"give a placement or a larger topology")

    def effective_topology(self) -> Topology:
        """The topology with hosts renamed to node ids (a uniform one when none was given)."""
        nodes = self.server_nodes + self.worker_nodes
        if self.topology is None:
            return Topology.uniform(nodes)
        hosts, failed = [], set()
        for n in nodes:
            h = self.topology.host(self.host_of(n))
            hosts.append(dataclasses.replace(h, name=n))
        rev = {}
        for n in nodes:
            rev.setdefault(self.host_of(n), []).append(n)
        for p in self.topology.failed:
            a, b = sorted(p)
            for x in rev.get(a, []):
                for y in rev.get(b, []):
                    failed.add(frozenset((x, y)))
        measured = {}
        for (a, b), v in self.topology.measured.items():
            for x in rev.get(a, []):
                for y in rev.get(b, []):
                    measured[(x, y)] = v
        return Topology(tuple(hosts), self.topology.uplinks, frozenset(failed), measured)

    def with_workers(self, workers: Sequence[int]) -> "World":
        return dataclasses.replace(self, workers=tuple(workers))

    def unplaced(self) -> list[str]:
        """The nodes :meth:`host_of` finds no topology host for (a topology smaller than the job)."""
        out = []
        for n in self.server_nodes + self.worker_nodes:
            try:
                self.host_of(n)
            except KeyError:
                out.append(n)
        return out

    def without(self, ranks) -> "World":
        """This world without workers ``ranks`` (departed), every remaining node on the host it had.

        (``with_workers`` alone would move nodes placed by launch order.)"""
        gone = {int(r) for r in ranks}
        placement = dict(self.placement)
        if self.topology is not None:
            for n in self.server_nodes + self.worker_nodes:
                if n not in placement:
                    try:
                        placement[n] = self.host_of(n)
                    except KeyError:
                        pass  # no host before either: host_of keeps raising for it
        return dataclasses.replace(self, workers=tuple(r for r in self.workers if r not in gone),
                                   placement=placement)


class Schedule(abc.ABC):
    """A round planner.  Subclasses set ``name``, ``apply_at``, ``needs_servers`` and implement ``plan``."""

    name = "abstract"
    apply_at = APPLY_AT_SERVER
    needs_servers = True  # False: runs with zero PS processes (rings)

    def __init__(self, world: World, *, rng: random.Random | None = None):
        if self.needs_servers and not world.shards:
            raise ValueError(f"schedule {self.name!r} needs at least one PS shard in its world")
        self.world = world
        self.rng = rng or random.Random(0)

    @abc.abstractmethod
    def plan(self, iteration: int) -> RoundPlan:
        """Every node's program for round ``iteration``."""

    def observe(self, reports: Sequence) -> None:
        """Link reports (:class:`LinkReport`) of the last round; adaptive planners replan from them."""

    def controller(self) -> Controller | None:
        """The run-time controller of a dynamic schedule (None for static ones)."""
        return None

    def predict_s(self, nbytes: int | None = None) -> float | None:
        """Predicted seconds for one round's communication (None: this planner has no model)."""
        return None

    def set_world(self, world: World) -> None:
        """Membership changed (a worker died or joined): plan for ``world`` from now on."""
        self.world = world
