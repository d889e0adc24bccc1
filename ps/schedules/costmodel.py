"""The alpha-beta cost model of collective schedules (the RSGCM paper's virtual environment).

Theory of operation
-------------------
Every transfer of ``D`` bytes over one connection costs ``tau = alpha + beta * D``
(RSGCM eq 7, Hockney's model): ``alpha`` is the connection latency ``tau_L`` in
seconds, ``beta`` the inverse bandwidth ``tau_B`` in seconds per byte.  Two
layers are built on it:

1. **Closed forms** (the paper's Table 4) for the textbook schedules on a uniform
   network: ring all-reduce, 2D-torus, 2D-mesh, double ring (eq 17), butterfly,
   recursive tree, hybrid and 2D-HRA.  Each returns a :class:`Cost` split into its
   latency and bandwidth parts, exactly as the table's two columns.  The helper
   functions ``F1``, ``F2``, ``F3`` are the paper's eq 8-10.
2. **A generic pricer** for any sequence of *ring steps* on any :class:`Network`.
   A step is a set of rings that run at the same time, each all-reducing its own
   block.  A ring of ``f`` devices on a block of ``D_b`` bytes runs ``2(f-1)``
   synchronous rounds (reduce-scatter then all-gather), each moving a chunk of
   ``D_b / f`` bytes over every hop of the ring, so it costs
   ``2(f-1) * max_hop(alpha_hop + beta_hop * D_b / f)``.  A step lasts as long
   as its slowest ring; steps run one after another.

Sharing.  A :class:`Network` may declare *shared resources* (a host NIC's
up/down rate, a rack uplink) with a rate in bytes per second, and which
resources each directed hop ``u -> v`` crosses.  Within one step every resource
is split equally between the hops that cross it, so a hop's effective inverse
bandwidth is ``max(beta_link, max_r(load_r / rate_r))``.  A network without
resources is the paper's port model (a device runs ``S`` concurrent sends and
receives at full link rate each, RSGCM section 3.1); a network built with
:meth:`Network.switched` is the lab's model (hosts on one switch, rings sharing
a host NIC split its rate, rack uplinks shared by every hop that leaves or
enters the rack).

This module is pure: plain data in, numbers out.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping, Sequence

__all__ = [
    "Cost", "Link", "Network", "F1", "F2", "F3",
    "ring_allreduce", "double_ring", "torus_2d", "mesh_2d", "butterfly", "recursive_tree", "hybrid", "hra_2d",
    "ring_seconds", "step_seconds", "schedule_seconds", "block_sizes",
]

MIN_RING_DEVICES = 2  # a "ring" of two devices is a plain exchange; RSGCM's search uses f >= 3


@dataclasses.dataclass(frozen=True)
class Cost:
    """A schedule's modelled time, split as Table 4 splits it (same unit as alpha/beta*D)."""

    latency: float
    bandwidth: float

    @property
    def total(self) -> float:
        return self.latency + self.bandwidth


# ---------------------------------------------------------------- Table 4 closed forms (uniform network)

def F1(D: float, N: float, tau_l: float, tau_b: float) -> float:
    """RSGCM eq 8: ``2 tau_L N - 2 tau_B D / N``."""
    return 2 * tau_l * N - 2 * tau_b * D / N


def F2(D: float, tau_l: float, tau_b: float) -> float:
    """RSGCM eq 9: ``tau_L + tau_B D``."""
    return tau_l + tau_b * D


def F3(D: float, tau_l: float, tau_b: float) -> float:
    """RSGCM eq 10: ``tau_L - tau_B D``."""
    return tau_l - tau_b * D


def _check_devices(**counts: int) -> None:
    for name, value in counts.items():
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive device count, got {value!r}")


def ring_allreduce(D: float, N: int, tau_l: float, tau_b: float) -> Cost:
    """Baidu ring all-reduce of ``D`` over ``N`` devices: ``T_L-r = 2 tau_L (N-1)``, ``T_B-r = 2 tau_B (N-1) D/N``."""
    _check_devices(N=N)
    return Cost(2 * tau_l * (N - 1), 2 * tau_b * (N - 1) * D / N)


def double_ring(D: float, N: int, tau_l: float, tau_b: float) -> Cost:
    """Two connection-disjoint N-rings at once, each on half the data (RSGCM eq 17): ``T_r(D/2, N)``."""
    return ring_allreduce(D / 2, N, tau_l, tau_b)


def torus_2d(D: float, i: int, j: int, tau_l: float, tau_b: float) -> Cost:
    """2D-Torus (Table 4): a ring all-reduce along rows of ``i`` then along columns of ``j``, on all of ``D``."""
    a, b = ring_allreduce(D, i, tau_l, tau_b), ring_allreduce(D, j, tau_l, tau_b)
    return Cost(a.latency + b.latency, a.bandwidth + b.bandwidth)


def mesh_2d(D: float, i: int, j: int, tau_l: float, tau_b: float) -> Cost:
    """2D-Mesh (Table 4): two steps, each the slower of a row and a column ring on ``D/2``."""
    worst = max((ring_allreduce(D / 2, k, tau_l, tau_b) for k in (i, j)), key=lambda c: c.total)
    return Cost(2 * worst.latency, 2 * worst.bandwidth)


def butterfly(D: float, N: int, tau_l: float, tau_b: float) -> Cost:
    """Butterfly (Table 4): ``ceil(log2 N)`` exchanges of all of ``D``."""
    _check_devices(N=N)
    rounds = math.ceil(math.log2(N)) if N > 1 else 0
    return Cost(tau_l * rounds, tau_b * D * rounds)


def recursive_tree(D: float, N: int, tau_l: float, tau_b: float) -> Cost:
    """Recursive tree (Table 4): a reduce then a broadcast, each a butterfly's cost."""
    b = butterfly(D, N, tau_l, tau_b)
    return Cost(2 * b.latency, 2 * b.bandwidth)


def hybrid(D: float, N: int, u: int, tau_l: float, tau_b: float) -> Cost:
    """Hybrid all-reduce (Table 4): rings of ``u`` and of ``N/u`` plus one extra transfer of ``D``."""
    _check_devices(N=N, u=u)
    if N % u:
        raise ValueError(f"hybrid all-reduce needs u to divide N (N={N}, u={u})")
    parts = [ring_allreduce(D, k, tau_l, tau_b) for k in (u, N // u)]
    return Cost(sum(p.latency for p in parts) + tau_l, sum(p.bandwidth for p in parts) + tau_b * D)


def hra_2d(D: float, i: int, j: int, u: int, tau_l: float, tau_b: float) -> Cost:
    """2D-HRA (Table 4, its latency and bandwidth columns): rings of ``i``, ``j`` and ``u``, each plus a transfer of D.

    The table's "Total" column for 2D-HRA does not equal the sum of its two
    columns as printed; this follows the two columns (see docs/schedules.md).
    """
    parts = [ring_allreduce(D, k, tau_l, tau_b) for k in (i, j, u)]
    return Cost(sum(p.latency + tau_l for p in parts), sum(p.bandwidth + tau_b * D for p in parts))


# ---------------------------------------------------------------- networks and the generic pricer

@dataclasses.dataclass(frozen=True)
class Link:
    """One connection of the connection matrix: ``alpha`` seconds latency, ``beta`` seconds per byte."""

    alpha: float
    beta: float

    def __post_init__(self):
        if not (self.alpha >= 0 and self.beta >= 0) or math.isinf(self.alpha) or math.isinf(self.beta):
            raise ValueError(f"link alpha and beta must be finite and >= 0, got {self.alpha!r}, {self.beta!r}")

    def seconds(self, nbytes: float) -> float:
        """RSGCM eq 7 for one transfer."""
        return self.alpha + self.beta * nbytes


def _pair(u: int, v: int) -> tuple[int, int]:
    return (u, v) if u < v else (v, u)


@dataclasses.dataclass(frozen=True)
class Network:
    """A connection matrix with per-connection alpha/beta and optional shared resources.

    ``links`` maps an undirected pair ``(u, v)`` with ``u < v`` to its :class:`Link`
    (both directions are full duplex with the same cost).  ``resources`` maps a
    name to a rate in bytes per second; ``hop_resources`` maps a *directed* hop
    ``(u, v)`` to the names of the resources it crosses.
    """

    n: int
    links: Mapping[tuple[int, int], Link]
    resources: Mapping[str, float] = dataclasses.field(default_factory=dict)
    hop_resources: Mapping[tuple[int, int], tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"a network needs at least one device, got n={self.n}")
        clean = {}
        for (u, v), link in self.links.items():
            if u == v or not (0 <= u < self.n and 0 <= v < self.n):
                raise ValueError(f"link ({u}, {v}) is not a pair of distinct devices in 0..{self.n - 1}")
            if not isinstance(link, Link):
                link = Link(*link)
            clean[_pair(u, v)] = link
        object.__setattr__(self, "links", clean)
        for name, rate in self.resources.items():
            if not rate > 0:
                raise ValueError(f"resource {name!r} needs a positive rate in bytes/s, got {rate!r}")
        for hop, names in self.hop_resources.items():
            unknown = [r for r in names if r not in self.resources]
            if unknown:
                raise ValueError(f"hop {hop} crosses undeclared resources {unknown}; add them to resources=")

    # -- construction helpers
    @classmethod
    def from_edges(cls, n: int, edges: Iterable[tuple[int, int]], alpha: float, beta: float) -> "Network":
        """A uniform connection matrix: every listed edge costs ``alpha + beta * D``."""
        return cls(n, {_pair(u, v): Link(alpha, beta) for u, v in edges})

    @classmethod
    def full_mesh(cls, n: int, alpha: float, beta: float) -> "Network":
        """Every pair of devices connected with the same link cost."""
        return cls.from_edges(n, [(u, v) for u in range(n) for v in range(u + 1, n)], alpha, beta)

    @classmethod
    def torus(cls, rows: int, cols: int, alpha: float, beta: float) -> "Network":
        """A ``rows x cols`` 2D torus, devices numbered row-major (device ``r*cols + c``)."""
        edges = set()
        for r in range(rows):
            for c in range(cols):
                here = r * cols + c
                for there in (r * cols + (c + 1) % cols, ((r + 1) % rows) * cols + c):
                    if there != here:
                        edges.add(_pair(here, there))
        return cls.from_edges(rows * cols, sorted(edges), alpha, beta)

    @classmethod
    def switched(cls, up_bps: Sequence[float], down_bps: Sequence[float] | None = None, *,
                 latency_s: float | Sequence[Sequence[float]] = 0.0, rack_of: Sequence[int] | None = None,
                 uplink_bps: Mapping[int, float] | None = None,
                 failed: Iterable[tuple[int, int]] = ()) -> "Network":
        """Hosts on a switch: every pair connected, each host's NIC shared by its hops.

        ``up_bps``/``down_bps`` are host NIC rates in bits per second.  Hops between
        racks also cross both racks' uplinks (``uplink_bps[rack]``, bits per second,
        full duplex: ``uplink_out:R`` and ``uplink_in:R``).  ``latency_s`` is the one-way
        latency, a scalar or an n x n matrix.  Pairs in ``failed`` are not connected.
        """
        n = len(up_bps)
        down_bps = list(up_bps) if down_bps is None else list(down_bps)
        if len(down_bps) != n:
            raise ValueError("up_bps and down_bps must list the same hosts")
        dead = {_pair(u, v) for u, v in failed}
        resources: dict[str, float] = {}
        for h in range(n):
            resources[f"up:{h}"] = up_bps[h] / 8.0
            resources[f"down:{h}"] = down_bps[h] / 8.0
        uplink_bps = dict(uplink_bps or {})
        for rack, bps in uplink_bps.items():
            resources[f"uplink_out:{rack}"] = bps / 8.0
            resources[f"uplink_in:{rack}"] = bps / 8.0
        links, hops = {}, {}
        for u in range(n):
            for v in range(n):
                if u == v:
                    continue
                lat = latency_s if isinstance(latency_s, (int, float)) else latency_s[u][v]
                if u < v and (u, v) not in dead:
                    links[(u, v)] = Link(float(lat), 0.0)
                names = [f"up:{u}", f"down:{v}"]
                if rack_of is not None and rack_of[u] != rack_of[v]:
                    if rack_of[u] in uplink_bps:
                        names.append(f"uplink_out:{rack_of[u]}")
                    if rack_of[v] in uplink_bps:
                        names.append(f"uplink_in:{rack_of[v]}")
                hops[(u, v)] = tuple(names)
        return cls(n, links, resources, hops)

    # -- queries
    def link(self, u: int, v: int) -> Link | None:
        """The connection between ``u`` and ``v``, or None if they are not connected."""
        return self.links.get(_pair(u, v))

    def connected(self, u: int, v: int) -> bool:
        return _pair(u, v) in self.links

    def neighbours(self, u: int) -> list[int]:
        """Devices connected to ``u``, in index order."""
        return sorted(b if a == u else a for (a, b) in self.links if u in (a, b))

    def max_degree(self) -> int:
        """``m`` of RSGCM Alg 1: the most connections any device has."""
        deg = [0] * self.n
        for a, b in self.links:
            deg[a] += 1
            deg[b] += 1
        return max(deg) if deg else 0

    def without(self, *, links: Iterable[tuple[int, int]] = (), devices: Iterable[int] = ()) -> "Network":
        """This network with some connections and every connection of some devices removed."""
        gone = {_pair(u, v) for u, v in links}
        dead = set(devices)
        kept = {p: l for p, l in self.links.items() if p not in gone and p[0] not in dead and p[1] not in dead}
        return Network(self.n, kept, self.resources, self.hop_resources)


def block_sizes(total_bytes: int, blocks: int) -> list[int]:
    """Split ``total_bytes`` into ``blocks`` equal blocks (the first ones one byte larger if it does not divide)."""
    if blocks < 1:
        raise ValueError(f"need at least one block, got {blocks}")
    base, extra = divmod(int(total_bytes), blocks)
    return [base + (1 if k < extra else 0) for k in range(blocks)]


def _hops(ring: Sequence[int]) -> list[tuple[int, int]]:
    f = len(ring)
    return [(ring[k], ring[(k + 1) % f]) for k in range(f)]


def _resource_loads(net: Network, rings: Iterable[Sequence[int]]) -> dict[str, int]:
    loads: dict[str, int] = {}
    for ring in rings:
        for hop in _hops(ring):
            for name in net.hop_resources.get(hop, ()):
                loads[name] = loads.get(name, 0) + 1
    return loads


def ring_seconds(net: Network, ring: Sequence[int], block_bytes: float,
                 loads: Mapping[str, int] | None = None) -> float:
    """Modelled time of one ring all-reduce of ``block_bytes``: ``2(f-1) * max_hop(alpha + beta_eff*D_b/f)``.

    ``loads`` (hops per shared resource in the same step) splits shared rates;
    by default the ring is alone.
    """
    f = len(ring)
    if f < MIN_RING_DEVICES:
        return 0.0
    if len(set(ring)) != f:
        raise ValueError(f"ring {list(ring)} visits a device twice")
    if loads is None:
        loads = _resource_loads(net, [ring])
    chunk = block_bytes / f
    worst = 0.0
    for u, v in _hops(ring):
        link = net.link(u, v)
        if link is None:
            raise ValueError(f"ring {list(ring)} uses ({u}, {v}), which the network does not connect")
        beta = link.beta
        for name in net.hop_resources.get((u, v), ()):
            beta = max(beta, loads[name] / net.resources[name])
        worst = max(worst, link.alpha + beta * chunk)
    return 2 * (f - 1) * worst


def step_seconds(net: Network, rings_and_bytes: Sequence[tuple[Sequence[int], float]]) -> float:
    """One step: rings (each with its block's bytes) running at once; lasts as long as the slowest ring."""
    loads = _resource_loads(net, [r for r, _ in rings_and_bytes])
    return max((ring_seconds(net, r, b, loads) for r, b in rings_and_bytes), default=0.0)


def schedule_seconds(net: Network, steps: Sequence[Sequence[tuple[Sequence[int], float]]]) -> float:
    """A schedule: its steps one after another."""
    return sum(step_seconds(net, step) for step in steps)
