"""RSGCM: ring all-reduce schedules planned by Monte Carlo Tree Search (Shi et al., TOMM 2022).

Theory of operation
-------------------
A *schedule* is a sequence of *actions* (communication steps).  An action is
``S`` ring-sets (``S`` is the system parameter: how many concurrent send and
receive processes a device runs); ring-set ``s`` all-reduces block ``b_s`` of
the ``S`` equal blocks of the model, the rings inside one ring-set share no
device, and no two rings of one action share a connection (eq 1-2).  The
planner has three parts, as in the paper's Fig 3:

1. **Search space** (section 3.1, Alg 1).  For every ring size ``f`` in the
   factor list (factors of ``N .. N+E`` with ``3 <= f < U``), every initial
   device ``I`` and every connection priority ``P in [0, m)`` (``m`` = the
   largest degree), Alg 1 walks the adjacency lists building rings of ``f``
   devices: from the current device ``K`` take ``Adj[K][P mod len]``; a pick
   that cannot extend the path (a device already on it, or an ``f``-th device
   that does not close the ring) is dropped and ``P`` advances
   (``P = (P+1) mod m``).  A closed ring leaves the device-availability matrix
   (DAM, reset per ring-set) and its connections leave the connection
   availability matrix (CAM, kept across the ring-sets of one action).  Each
   construction is combined with every assignment of the ``S`` blocks to the
   ``S`` ring-sets; duplicates are dropped.  (Our exact reading of the vague
   points is in ``docs/schedules.md``; it reproduces the paper's Fig 4.)
2. **MCTS** (section 3.2).  A tree node is a data distribution (the state
   tensor ``data[i][j][k]``: device ``i`` holds device ``j``'s contribution to
   block ``k``; eq 5 initially, eq 6 when done), stored as one bitmask per
   ``(i, k)``.  Its children are the actions that are valid from it: an action
   is pruned when one of its rings would add a contribution twice (two members
   already share a contributor: a double count) or when it adds nothing.  An
   episode walks from the root choosing the child that maximises eq 3
   (``R + lambda * p * sqrt(n) / (1 + n_child)``, uniform prior ``p``, ties by the
   seeded RNG) until the state is done (eq 6), the step budget ``St`` is spent,
   or no child is left.  ``lambda`` decays linearly (eq 14) over the first
   ``Ep_ex`` episodes.  Rewards are backed up along the path with eq 4.
   Pruned for good (section 3.2's three rules): a node whose partial time is
   already no better than the best complete schedule, a node at depth ``St``
   that is not done, a done node once evaluated, and a node whose children are
   all pruned.  When the root is pruned the space is exhausted: the incumbent is
   the optimum of the space.
3. **Environment** (section 3.3).  The virtual environment prices an action
   with the alpha-beta model (``ltp_ps.schedules.costmodel``: a ring of ``f``
   on a block of ``D_b`` costs ``2(f-1)(alpha + beta*D_b/f)``, rings sharing a
   NIC split its rate); a schedule costs the sum of its steps.  The reward is
   the rank of the schedule's time in the sorted (descending) list of distinct
   times seen so far, with a leading 0 for unfinished episodes.  The real
   environment re-ranks the best ``TOP_CANDIDATES`` schedules by measured
   all-reduce time with eq 13 (``D (N-1) N / T``): :meth:`RsgcmPlanner.next_to_measure`
   hands the executor the next candidate to run, and
   :meth:`RsgcmPlanner.record_measurement` takes the measured seconds back.

Replanning.  :meth:`RsgcmPlanner.fail_link` / :meth:`RsgcmPlanner.fail_device`
drop every action that uses the failed connection or device, add the
actions Alg 1 builds on the degraded graph, rebuild the tree and keep
searching; :meth:`RsgcmPlanner.current_plan` meanwhile returns the best valid
schedule found so far, else a single ring through the survivors.
:meth:`RsgcmPlanner.update_network` does the same for new link estimates
(repricing the schedules found).  :func:`programs` compiles a plan into the
layer's per-worker round programs; :class:`RsgcmSchedule` is the ``rsgcm``
round planner over a ``World``.

Everything here is pure: plain data in, plain data out, randomness only from
the ``random.Random`` passed in, no clock.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import random
from typing import Callable, Iterable, Mapping, Sequence

from ..errors import TrainingFailed
from .base import Schedule
from .costmodel import Link, Network, block_sizes, ring_seconds, step_seconds
from .program import (APPLY_AT_WORKERS, RELIABLE, SLOT_ACC, TOLERANT, Adopt, Apply, Combine, Compute, Program, Recv,
                      RoundPlan, Send)
from .program import worker as worker_node
from .tags import MAX_STEP, PHASE_ALL_GATHER, PHASE_REDUCE_SCATTER, pack as pack_tag

__all__ = [
    "RingSet", "Action", "RingPlan", "SearchParams", "RsgcmPlanner", "PlanningError", "RewardList",
    "exploration_weight",
    "factor_list", "construct_action", "build_search_space", "initial_state", "apply_action", "is_done",
    "exhaustive_search", "allreduce_reward", "rerank", "as_network", "fallback_ring", "plan", "programs",
    "price_plan", "RsgcmSchedule", "SCHEDULE",
]

MIN_RING = 3  # Alg 1's smallest ring (f >= 3)
DEFAULT_EXTENSION = 1  # E: factor list from the factors of N .. N+E
LAMBDA_START = 10.0  # lambda_1 of eq 14
LAMBDA_END = 0.0  # lambda_2 of eq 14
EPISODES_PER_ACTION = 8  # Ep = 8 * M (section 4.1)
EXPLORE_FRACTION = 0.5  # Ep_ex = Ep / 2 (section 4.3: half the episodes explore)
TOP_CANDIDATES = 5  # schedules the real environment re-ranks (eq 13)
CANDIDATE_SLACK = 1.25  # only plans predicted within this factor of the best are worth a measured round
HAMILTON_BUDGET = 200_000  # DFS node visits when looking for a fallback ring of the survivors

Ring = tuple  # tuple[int, ...] device ids in ring order


class PlanningError(TrainingFailed, RuntimeError):
    """No schedule can be produced (e.g. the survivors' graph holds no ring): the job cannot make progress."""


# ---------------------------------------------------------------- actions and plans

def _pair(u: int, v: int) -> tuple[int, int]:
    return (u, v) if u < v else (v, u)


def ring_connections(ring: Sequence[int]) -> list[tuple[int, int]]:
    """The undirected connections a ring uses (``f`` of them; a 2-ring uses its one connection)."""
    f = len(ring)
    if f == 2:
        return [_pair(ring[0], ring[1])]
    return [_pair(ring[k], ring[(k + 1) % f]) for k in range(f)]


def _canonical_ring(ring: Sequence[int]) -> tuple:
    """Rotation starting at the smallest device, direction with the smaller second device."""
    r = list(ring)
    k = r.index(min(r))
    r = r[k:] + r[:k]
    if len(r) > 2 and r[-1] < r[1]:
        r = [r[0]] + r[1:][::-1]
    return tuple(r)


@dataclasses.dataclass(frozen=True)
class RingSet:
    """Rings (device lists in ring order) that all-reduce block ``block`` at the same time; they share no device."""

    block: int
    rings: tuple = ()  # tuple[Ring, ...]

    def __post_init__(self):
        object.__setattr__(self, "rings", tuple(tuple(int(d) for d in r) for r in self.rings))


@dataclasses.dataclass(frozen=True)
class Action:
    """One communication step: ring-set ``s`` reduces block ``ring_sets[s].block``."""

    ring_sets: tuple  # tuple[RingSet, ...]

    def __post_init__(self):
        object.__setattr__(self, "ring_sets", tuple(self.ring_sets))

    def rings(self) -> list:
        return [r for rs in self.ring_sets for r in rs.rings]

    def connections(self) -> set:
        return {c for r in self.rings() for c in ring_connections(r)}

    def devices(self) -> set:
        return {d for r in self.rings() for d in r}

    def key(self) -> tuple:
        """Identity up to ring rotation/direction and ring order inside a ring-set."""
        return tuple(sorted((rs.block, tuple(sorted(_canonical_ring(r) for r in rs.rings)))
                            for rs in self.ring_sets if rs.rings))

    def violations(self) -> list[str]:
        """Why this is not a valid action (empty if it is): eq 1's device/connection disjointness."""
        out = []
        blocks = [rs.block for rs in self.ring_sets]
        if len(set(blocks)) != len(blocks):
            out.append(f"two ring-sets reduce the same block: {blocks}")
        for s, rs in enumerate(self.ring_sets):
            seen: set = set()
            for r in rs.rings:
                if len(set(r)) != len(r):
                    out.append(f"ring {list(r)} visits a device twice")
                if seen & set(r):
                    out.append(f"ring-set {s} uses devices {sorted(seen & set(r))} in two rings")
                seen |= set(r)
        used: set = set()
        for r in self.rings():
            cs = set(ring_connections(r))
            if used & cs:
                out.append(f"ring {list(r)} reuses connections {sorted(used & cs)}")
            used |= cs
        return out

    def to_json(self) -> list:
        return [{"block": rs.block, "rings": [list(r) for r in rs.rings]} for rs in self.ring_sets]


@dataclasses.dataclass(frozen=True)
class RingPlan:
    """A complete RSGCM schedule: its steps (actions), run one after another.

    ``devices`` are the devices it all-reduces over; ``blocks`` the number of
    equal blocks the ``total_bytes`` are cut into; ``predicted_s`` the virtual
    environment's time; ``source`` is ``"mcts"``, ``"exhaustive"`` or
    ``"fallback"``; ``measured_s`` the real environment's time when known.
    """

    devices: tuple
    blocks: int
    total_bytes: int
    steps: tuple  # tuple[Action, ...]
    predicted_s: float
    source: str = "mcts"
    measured_s: float | None = None

    def key(self) -> tuple:
        return tuple(a.key() for a in self.steps)

    def ring_sets(self) -> list[list[dict]]:
        """Per step, per ring-set: its block and rings (plain data)."""
        return [a.to_json() for a in self.steps]

    def uses_link(self, u: int, v: int) -> bool:
        return any(_pair(u, v) in a.connections() for a in self.steps)

    def uses_device(self, d: int) -> bool:
        return any(d in a.devices() for a in self.steps)

    def to_json(self) -> dict:
        return {"schedule": "rsgcm", "devices": list(self.devices), "blocks": self.blocks,
                "total_bytes": self.total_bytes, "predicted_s": self.predicted_s, "measured_s": self.measured_s,
                "source": self.source, "steps": self.ring_sets()}


# ---------------------------------------------------------------- network adapter

def as_network(net, *, names: Sequence[str] | None = None, alpha: float = 0.0, beta: float = 0.0) -> Network:
    """A :class:`~ltp_ps.schedules.costmodel.Network` from what the caller has.

    Accepts a ``Network`` (returned as is); a ``Topology`` (``names`` orders its
    hosts as devices 0..N-1, default the topology's order: every alive pair is
    connected with its path latency as alpha, hops share the host NICs and rack
    uplinks they cross, a measured bottleneck becomes the link's beta); or an
    N x N matrix whose entries are falsy (no connection), truthy (connected at
    ``alpha``/``beta``), or an ``(alpha, beta)`` pair.
    """
    if isinstance(net, Network):
        return net
    if hasattr(net, "path_links") and hasattr(net, "hosts"):
        return _network_from_topology(net, list(names) if names is not None else list(net.names))
    try:
        rows = [list(r) for r in net]
    except TypeError:
        raise TypeError(f"cannot plan on {type(net).__name__}; pass a Network, a Topology or an N x N matrix") from None
    n = len(rows)
    if any(len(r) != n for r in rows):
        raise ValueError("a connection matrix must be square (N rows of N entries)")
    links = {}
    for u in range(n):
        for v in range(u + 1, n):
            e, e2 = rows[u][v], rows[v][u]
            if bool(_truthy(e)) != bool(_truthy(e2)):
                raise ValueError(f"connection matrix is not symmetric at ({u}, {v})")
            if not _truthy(e):
                continue
            links[(u, v)] = Link(*e) if isinstance(e, (tuple, list)) else Link(alpha, beta)
    return Network(n, links)


def _truthy(e) -> bool:
    if isinstance(e, (tuple, list)):
        return len(e) == 2
    return bool(e)


def _network_from_topology(topo, names: list[str]) -> Network:
    idx = {name: i for i, name in enumerate(names)}
    resources: dict[str, float] = {}
    hops: dict = {}
    links = {}
    for a in names:
        for b in names:
            if a == b or not topo.alive(a, b):
                continue
            res = []
            for link in topo.path_links(a, b):
                rname = f"{link[0]}:{link[1]}"
                resources[rname] = topo.link_rate(link) / 8.0
                res.append(rname)
            measured = topo.measured.get((a, b))
            beta = 8.0 / measured[1] if measured is not None and measured[1] > 0 else 0.0
            hops[(idx[a], idx[b])] = tuple(res)
            u, v = _pair(idx[a], idx[b])
            lat = max(topo.path_latency(a, b), topo.path_latency(b, a))
            old = links.get((u, v))
            links[(u, v)] = Link(lat, beta) if old is None else Link(max(old.alpha, lat), max(old.beta, beta))
    # a pair is connected only if both directions are alive
    links = {p: l for p, l in links.items() if (p[0], p[1]) in hops and (p[1], p[0]) in hops}
    return Network(len(names), links, resources, hops)


# ---------------------------------------------------------------- search space (Alg 1)

def factor_list(n: int, extension: int = DEFAULT_EXTENSION, upper: int | None = None) -> list[int]:
    """FL: the factors ``f`` of ``N .. N+E`` with ``3 <= f < U`` (and ``f <= N``: a ring needs f devices)."""
    upper = n + 1 if upper is None else upper
    out = set()
    for x in range(n, n + extension + 1):
        for f in range(MIN_RING, min(upper - 1, n, x) + 1):
            if x % f == 0:
                out.add(f)
    return sorted(out)


def _expected_loads(net: Network, devices: Sequence[int]) -> dict:
    """Per shared resource, how many hops of a ring through ``devices`` are expected to cross it.

    A ring gives every device one outgoing hop to one of its ``n - 1`` peers, so a
    resource crossed by ``h`` of the possible directed hops carries ``h / (n - 1)``
    of them on average (a host NIC: 1; a rack uplink: more when many pairs cross it).
    """
    live = set(devices)
    n = len(live)
    counts: dict = {}
    for (u, v), names in net.hop_resources.items():
        if u in live and v in live and net.connected(u, v):
            for name in names:
                counts[name] = counts.get(name, 0) + 1
    return {name: c / max(n - 1, 1) for name, c in counts.items()}


def _hop_weight(net: Network, u: int, v: int, nbytes: float, loads: Mapping[str, float]) -> float:
    """Expected cost of moving ``nbytes`` over ``u -> v`` in a ring (Adj ordering: cheaper first)."""
    link = net.link(u, v)
    beta = link.beta
    for name in net.hop_resources.get((u, v), ()):
        beta = max(beta, max(1.0, loads.get(name, 1.0)) / net.resources[name])
    return link.alpha + beta * nbytes


def construct_action(net: Network, f: int, initial: int, priority: int, *, sets: int, devices: Sequence[int],
                     ref_bytes: float = 0.0, m: int | None = None) -> list[list[Ring]]:
    """Alg 1: the ring-sets (without blocks) built from initial device ``I`` with connection priority ``P``.

    ``devices`` are the live devices; each adjacency list is ordered by the
    expected cost of sending ``ref_bytes`` (a block) over the hop, then by device
    index (a hop through a shared uplink counts its expected sharing).  Returns ``sets`` lists of
    rings; a list may be empty when no ring of ``f`` can be closed.
    """
    live = sorted(devices)
    if m is None:
        m = max((sum(1 for v in live if v != u and net.connected(u, v)) for u in live), default=0)
    if m < 1 or f < MIN_RING:
        return [[] for _ in range(sets)]
    cam = {p for p in net.links if p[0] in set(live) and p[1] in set(live)}
    loads = _expected_loads(net, live)
    weight_cache: dict = {}

    def adj(k: int, dam: set) -> list[int]:
        cands = [x for x in dam if _pair(k, x) in cam]
        def w(x):
            key = (k, x)
            if key not in weight_cache:
                weight_cache[key] = _hop_weight(net, k, x, ref_bytes, loads)
            return weight_cache[key]
        return sorted(cands, key=lambda x: (w(x), x))

    P = priority % m
    out: list[list[Ring]] = []
    for _s in range(sets):
        dam = set(live)
        rings: list[Ring] = []
        dead_starts: set = set()
        first = True
        while len(dam) >= f:
            starts = sorted(dam - dead_starts)
            if not starts:
                break
            start = initial if first and initial in starts else starts[0]
            first = False
            ring, P = _walk(start, f, P, m, dam, cam, adj)
            if ring is None:
                dead_starts.add(start)
                continue
            rings.append(ring)
            dam -= set(ring)
            cam -= set(ring_connections(ring))
        out.append(rings)
    return out


def _walk(start: int, f: int, P: int, m: int, dam: set, cam: set, adj) -> tuple:
    """One ring of Alg 1 from ``start`` (lines 5-19).  Returns ``(ring or None, P)``.

    A pick that is already on the path, or an ``f``-th device that does not
    close the ring, is removed and ``P`` advances; ``m`` failures in a row at one
    position mean no ring can be closed from this start.
    """
    path = [start]
    on_path = {start}
    k = start
    fails = 0
    while True:
        a = adj(k, dam)
        if not a:
            return None, P
        cand = a[P % len(a)]
        if cand not in on_path:
            if len(path) + 1 < f:
                path.append(cand)
                on_path.add(cand)
                k = cand
                fails = 0
                continue
            if _pair(cand, start) in cam:
                return tuple(path + [cand]), P
        P = (P + 1) % m
        fails += 1
        if fails >= m:
            return None, P


def build_search_space(net: Network, *, sets: int, devices: Sequence[int] | None = None,
                       extension: int = DEFAULT_EXTENSION, upper: int | None = None,
                       ref_bytes: float = 0.0) -> list[Action]:
    """Every distinct action Alg 1 builds over ``f in FL``, ``I in devices``, ``P in [0, m)``, times block orders."""
    live = sorted(range(net.n) if devices is None else devices)
    n = len(live)
    m = max((sum(1 for v in live if v != u and net.connected(u, v)) for u in live), default=0)
    seen: set = set()
    out: list[Action] = []
    for f in factor_list(n, extension, upper):
        for initial in live:
            for priority in range(max(m, 1)):
                ring_sets = construct_action(net, f, initial, priority, sets=sets, devices=live,
                                             ref_bytes=ref_bytes, m=m)
                if not any(ring_sets):
                    continue
                for order in itertools.permutations(range(sets)):
                    act = Action(tuple(RingSet(order[s], tuple(ring_sets[s])) for s in range(sets)))
                    k = act.key()
                    if k not in seen:
                        seen.add(k)
                        out.append(act)
    return out


# ---------------------------------------------------------------- state tensor (eq 5-6)

def initial_state(devices: Sequence[int], blocks: int) -> dict:
    """eq 5: ``data[i][j][k] = 1`` iff ``i == j``; as ``{device: (mask_block0, mask_block1, ...)}``."""
    pos = {d: p for p, d in enumerate(sorted(devices))}
    return {d: tuple(1 << pos[d] for _ in range(blocks)) for d in pos}


def is_done(state: Mapping) -> bool:
    """eq 6: every device holds every device's contribution to every block."""
    full = (1 << len(state)) - 1
    return all(m == full for masks in state.values() for m in masks)


def apply_action(state: Mapping, action: Action) -> dict | None:
    """The state after ``action``, or None if it is pruned (a ring double-counts, or nothing new arrives)."""
    new = {d: list(m) for d, m in state.items()}
    changed = False
    for rs in action.ring_sets:
        k = rs.block
        for ring in rs.rings:
            union = 0
            for d in ring:
                masks = state.get(d)
                if masks is None:
                    return None  # a device outside the all-reduce (failed)
                if union & masks[k]:
                    return None  # double count: two members already share a contributor
                union |= masks[k]
            for d in ring:
                if new[d][k] != union:
                    new[d][k] = union
                    changed = True
    if not changed:
        return None
    return {d: tuple(m) for d, m in new.items()}


def _state_key(state: Mapping) -> tuple:
    return tuple(sorted(state.items()))


# ---------------------------------------------------------------- environment helpers

def allreduce_reward(total_bytes: float, n: int, seconds: float) -> float:
    """eq 13: valid data moved per second, ``D (N-1) N / T``."""
    if seconds <= 0:
        raise ValueError(f"a measured all-reduce time must be > 0 seconds, got {seconds!r}")
    return total_bytes * (n - 1) * n / seconds


def rerank(candidates: Sequence[RingPlan], measure: Callable[[RingPlan], float]) -> RingPlan:
    """The real environment: run each candidate through ``measure`` (seconds) and keep the best by eq 13."""
    if not candidates:
        raise ValueError("rerank needs at least one candidate plan")
    best, best_r = None, -math.inf
    for plan in candidates:
        t = float(measure(plan))
        r = allreduce_reward(plan.total_bytes, len(plan.devices), t)
        if r > best_r:
            best, best_r = dataclasses.replace(plan, measured_s=t), r
    return best


def _price(net: Network, action: Action, sizes: Sequence[int]) -> float:
    return step_seconds(net, [(ring, sizes[rs.block]) for rs in action.ring_sets for ring in rs.rings])


def fallback_ring(net: Network, devices: Sequence[int], *, budget: int = HAMILTON_BUDGET) -> Ring | None:
    """A single ring through every device in ``devices`` (rank order if it is one), or None if none is found."""
    live = sorted(devices)
    n = len(live)
    if n <= 1:
        return tuple(live)
    if n == 2:
        return tuple(live) if net.connected(*live) else None
    if all(net.connected(live[k], live[(k + 1) % n]) for k in range(n)):
        return tuple(live)
    nbrs = {u: [v for v in live if v != u and net.connected(u, v)] for u in live}
    path, on = [live[0]], {live[0]}
    visits = 0

    def dfs() -> bool:
        nonlocal visits
        visits += 1
        if visits > budget:
            return False
        if len(path) == n:
            return net.connected(path[-1], path[0])
        for v in nbrs[path[-1]]:
            if v not in on:
                path.append(v)
                on.add(v)
                if dfs():
                    return True
                on.discard(v)
                path.pop()
        return False

    return tuple(path) if dfs() else None


# ---------------------------------------------------------------- MCTS

@dataclasses.dataclass
class SearchParams:
    """RSGCM's hyper-parameters (section 4.1).  ``None`` means the paper's default for the instance."""

    sets: int = 1  # S, the system parameter (= number of blocks)
    extension: int = DEFAULT_EXTENSION  # E
    upper: int | None = None  # U (default N + 1: rings of up to N devices)
    episodes: int | None = None  # Ep (default EPISODES_PER_ACTION * M)
    explore_episodes: int | None = None  # Ep_ex (default EXPLORE_FRACTION * Ep)
    max_steps: int | None = None  # St (default N)
    lambda_start: float = LAMBDA_START  # lambda_1
    lambda_end: float = LAMBDA_END  # lambda_2
    top_k: int = TOP_CANDIDATES
    candidate_slack: float = CANDIDATE_SLACK  # re-rank only plans predicted within this factor of the best

    def __post_init__(self):
        if self.sets < 1:
            raise ValueError(f"S (sets) must be >= 1, got {self.sets}")
        if self.extension < 0:
            raise ValueError(f"E (extension) must be >= 0, got {self.extension}")
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if not self.candidate_slack >= 1.0:
            raise ValueError(f"candidate_slack must be >= 1 (a factor of the best time), got {self.candidate_slack}")


def exploration_weight(episode: int, explore_episodes: int, start: float = LAMBDA_START,
                       end: float = LAMBDA_END) -> float:
    """eq 14: ``lambda = lambda_1 - (lambda_1 - lambda_2) / Ep_ex * Ep_c``, held at ``lambda_2`` after ``Ep_ex``."""
    if explore_episodes <= 0 or episode >= explore_episodes:
        return end
    return start - (start - end) / explore_episodes * episode


class RewardList:
    """Section 3.3's reward: the rank of a schedule's time in ``[0, t_worst, ..., t_best]``.

    The list starts as ``[0]`` (unfinished episodes get 0); a finished
    schedule's time is inserted in descending order (once: equal times share a
    rank) and its index is the reward.  The paper's example: with
    ``[0, 8.3, 6.5, 4.7]`` a time of 6.5 earns 2 and a time of 5.4 earns 3.
    """

    def __init__(self, times: Iterable[float] = ()):
        self._asc: list[float] = sorted(set(times))

    def reward(self, t: float) -> int:
        greater = len(self._asc) - bisect.bisect_right(self._asc, t)
        i = bisect.bisect_left(self._asc, t)
        if i == len(self._asc) or self._asc[i] != t:
            self._asc.insert(i, t)
        return 1 + greater

    def as_list(self) -> list:
        """``[0, t_worst, ..., t_best]`` as in the paper."""
        return [0] + self._asc[::-1]


class _Node:
    __slots__ = ("state", "time", "depth", "action", "parent", "children", "live_kids", "n", "W", "R", "dead",
                 "done")

    def __init__(self, state, time, depth, action, parent, done):
        self.state = state
        self.time = time  # seconds so far (virtual environment)
        self.depth = depth
        self.action = action  # index into the search space of the step that led here
        self.parent = parent
        self.children = None  # list[_Node] once expanded
        self.live_kids = 0  # children not pruned yet
        self.n = 0
        self.W = 0.0
        self.R = 0.0
        self.dead = False
        self.done = done


class RsgcmPlanner:
    """The RSGCM search for one all-reduce (``total_bytes`` per device) over ``net``.

    Sans-IO: :meth:`search` runs a number of MCTS episodes and returns; call it
    between rounds to "keep searching".  :meth:`current_plan` is always
    answerable.  ``rng`` is the only source of randomness.
    """

    def __init__(self, net, total_bytes: int, *, params: SearchParams | None = None, rng: random.Random | None = None,
                 devices: Sequence[int] | None = None):
        self.net = as_network(net)
        self.total_bytes = int(total_bytes)
        if self.total_bytes < 0:
            raise ValueError("total_bytes must be >= 0")
        self.params = params or SearchParams()
        if rng is None:
            raise ValueError("RsgcmPlanner needs rng=random.Random(seed): the planner takes no hidden randomness")
        self.rng = rng
        self.devices = tuple(sorted(range(self.net.n) if devices is None else devices))
        self.failed_links: set = set()
        self.failed_devices: set = set()
        self.sizes = block_sizes(self.total_bytes, self.params.sets)
        self.space: list[Action] = build_search_space(
            self.net, sets=self.params.sets, devices=self.devices, extension=self.params.extension,
            upper=self.params.upper, ref_bytes=self.sizes[0])
        self.completed: dict = {}  # plan key -> (time, tuple of actions)
        self.measured: dict = {}  # plan key -> measured seconds
        self.episodes_run = 0
        self._reset_tree()

    # -- bookkeeping
    @property
    def alive(self) -> tuple:
        return tuple(d for d in self.devices if d not in self.failed_devices)

    def _live_net(self) -> Network:
        return self.net.without(links=self.failed_links, devices=self.failed_devices)

    def _action_ok(self, a: Action) -> bool:
        if a.devices() & self.failed_devices:
            return False
        conns = a.connections()
        return not (conns & self.failed_links) and all(self.net.connected(*c) for c in conns)

    def _reset_tree(self) -> None:
        self._live = [i for i, a in enumerate(self.space) if self._action_ok(a)]
        net = self._live_net()
        self._cost = {i: _price(net, self.space[i], self.sizes) for i in self._live}
        n_live = len(self.alive)
        self._St = self.params.max_steps or max(n_live, 1)
        M = max(len(self._live), 1)
        self._Ep = self.params.episodes if self.params.episodes is not None else EPISODES_PER_ACTION * M
        self._Ep_ex = (self.params.explore_episodes if self.params.explore_episodes is not None
                       else max(1, int(EXPLORE_FRACTION * self._Ep)))
        self._episode = 0
        state = initial_state(self.alive, self.params.sets)
        self.root = _Node(state, 0.0, 0, None, None, is_done(state))
        self._rewards = RewardList(t for t, _ in self.completed.values())
        self._best = min((t for t, _ in self.completed.values()), default=math.inf)

    @property
    def exhausted(self) -> bool:
        """True when every schedule of the space has been evaluated or pruned (the incumbent is optimal)."""
        return self.root.dead

    @property
    def budget_left(self) -> int:
        """Episodes left of Ep in the current tree."""
        return max(0, self._Ep - self._episode)

    def _lambda(self) -> float:
        p = self.params
        return exploration_weight(self._episode, self._Ep_ex, p.lambda_start, p.lambda_end)

    def _expand(self, node: _Node) -> list:
        kids = []
        for i in self._live:
            st = apply_action(node.state, self.space[i])
            if st is None:
                continue
            # the state is recomputed when the child is first selected: most children never are
            kids.append(_Node(None, node.time + self._cost[i], node.depth + 1, i, node, is_done(st)))
        node.children = kids
        node.live_kids = len(kids)
        return kids

    def _select(self, node: _Node, lam: float) -> _Node | None:
        live = [c for c in node.children if not c.dead]
        if not live:
            return None
        p = 1.0 / len(node.children)
        sq = math.sqrt(node.n)
        best, best_s = [], -math.inf
        for c in live:
            s = c.R + lam * p * sq / (1 + c.n)  # eq 3
            if s > best_s:
                best, best_s = [c], s
            elif s == best_s:
                best.append(c)
        return best[0] if len(best) == 1 else self.rng.choice(best)

    @staticmethod
    def _kill(node: _Node) -> None:
        """Prune ``node``; a parent whose children are all pruned is pruned too."""
        while node is not None and not node.dead:
            node.dead = True
            p = node.parent
            if p is None:
                return
            p.live_kids -= 1
            if p.live_kids > 0:
                return
            node = p

    def _episode_once(self) -> None:
        lam = self._lambda()
        node = self.root
        path = [node]
        reward = 0.0
        while True:
            if node.done:
                reward = self._record(node)
                self._kill(node)  # evaluated: nothing below a finished schedule can improve it
                break
            if node.time >= self._best:
                self._kill(node)  # rule 1: already no better than the best complete schedule
                break
            if node.depth >= self._St:
                self._kill(node)  # rule 3: step budget spent without finishing
                break
            if node.children is None:
                self._expand(node)
            nxt = self._select(node, lam)
            if nxt is None:
                self._kill(node)  # rule 2 left nothing valid below
                break
            if nxt.state is None:
                nxt.state = apply_action(node.state, self.space[nxt.action])
            node = nxt
            path.append(node)
        for nd in path:  # eq 4
            nd.n += 1
            nd.W += reward
            nd.R = nd.W / nd.n
        self._episode += 1
        self.episodes_run += 1

    def _record(self, node: _Node) -> float:
        steps = []
        nd = node
        while nd.parent is not None:
            steps.append(nd.action)
            nd = nd.parent
        acts = tuple(self.space[i] for i in reversed(steps))
        key = tuple(a.key() for a in acts)
        if key not in self.completed or node.time < self.completed[key][0]:
            self.completed[key] = (node.time, acts)
        self._best = min(self._best, node.time)
        return float(self._rewards.reward(node.time))

    # -- public API
    def search(self, episodes: int | None = None) -> int:
        """Run up to ``episodes`` MCTS episodes (default: what is left of Ep); returns how many ran."""
        todo = self.budget_left if episodes is None else int(episodes)
        ran = 0
        while ran < todo and not self.root.dead and not self.root.done:
            self._episode_once()
            ran += 1
        return ran

    def best_plan(self) -> RingPlan | None:
        """The best valid schedule found by the virtual environment, or None."""
        valid = self._valid_completed()
        if not valid:
            return None
        t, acts = min(valid, key=lambda x: (x[0], len(x[1])))
        return self._plan(acts, t, "exhaustive" if self.exhausted else "mcts")

    def candidates(self, k: int | None = None) -> list[RingPlan]:
        """The ``k`` (default ``top_k``) best valid schedules by predicted time, best first.

        Only schedules predicted within ``candidate_slack`` of the best are listed:
        each one costs the real environment a round.
        """
        k = self.params.top_k if k is None else k
        valid = sorted(self._valid_completed(), key=lambda x: (x[0], len(x[1])))[:k]
        if valid:
            limit = valid[0][0] * self.params.candidate_slack
            valid = [v for v in valid if v[0] <= limit]
        return [self._plan(acts, t, "mcts") for t, acts in valid]

    def next_to_measure(self) -> RingPlan | None:
        """The first of :meth:`candidates` the real environment has not measured yet (None: all measured)."""
        for plan in self.candidates():
            if plan.key() not in self.measured:
                return plan
        return None

    def record_measurement(self, plan: RingPlan, seconds: float) -> None:
        """The executor's measured all-reduce time of ``plan`` (its eq 13 reward ranks the candidates)."""
        allreduce_reward(plan.total_bytes, len(plan.devices), seconds)  # validates seconds
        self.measured[plan.key()] = float(seconds)

    def current_plan(self) -> RingPlan:
        """What to run now: the best measured candidate once every candidate is measured, else the best
        predicted valid schedule, else a ring through the survivors (raises :class:`PlanningError` if none)."""
        cands = self.candidates()
        if cands and all(c.key() in self.measured for c in cands):
            n = len(self.alive)
            best = max(cands, key=lambda c: allreduce_reward(c.total_bytes, n, self.measured[c.key()]))
            return dataclasses.replace(best, measured_s=self.measured[best.key()], source="measured")
        if cands:
            return cands[0]
        return self.fallback_plan()

    def fallback_plan(self) -> RingPlan:
        """One ring all-reduce over every survivor (block count 1)."""
        live = self.alive
        ring = fallback_ring(self._live_net(), live)
        if ring is None:
            raise PlanningError(f"no ring connects the surviving devices {list(live)}; search longer "
                                f"(planner.search) or restore a connection")
        steps = (Action((RingSet(0, (ring,)),)),) if len(ring) >= 2 else ()
        t = ring_seconds(self._live_net(), ring, self.total_bytes) if len(ring) >= 2 else 0.0
        return RingPlan(live, 1, self.total_bytes, steps, t, "fallback")

    def fail_link(self, u: int, v: int) -> None:
        """Connection ``u``-``v`` is gone: drop every action using it, extend the space, keep searching."""
        self.failed_links.add(_pair(u, v))
        self._replan()

    def fail_device(self, d: int) -> None:
        """Device ``d`` is gone: the all-reduce continues over the survivors."""
        if d not in self.devices:
            raise ValueError(f"device {d} is not one of {list(self.devices)}")
        self.failed_devices.add(d)
        self._replan()

    def update_network(self, net) -> None:
        """New link estimates for the same devices (measured rates, a changed topology): reprice the space and
        the schedules found, add what Alg 1 builds on the new graph, rebuild the tree and keep searching.

        Connections the new network lacks make the actions using them invalid; real
        measurements belong to the old network and are dropped.
        """
        net = as_network(net)
        if net.n != self.net.n:
            raise ValueError(f"update_network keeps the devices ({self.net.n}); got a network of {net.n}: "
                             f"build a new RsgcmPlanner for a different device set")
        self.net = net
        self.measured = {}
        self._replan()

    def _replan(self) -> None:
        seen = {a.key() for a in self.space}
        extra = build_search_space(self._live_net(), sets=self.params.sets, devices=self.alive,
                                   extension=self.params.extension, upper=self.params.upper,
                                   ref_bytes=self.sizes[0])
        self.space.extend(a for a in extra if a.key() not in seen)
        live_net = self._live_net()
        self.completed = {k: (sum(_price(live_net, a, self.sizes) for a in acts), acts)
                          for k, (_, acts) in self.completed.items() if self._plan_ok(acts)}
        self.measured = {k: v for k, v in self.measured.items() if k in self.completed}
        self._reset_tree()

    # -- helpers
    def _plan_ok(self, acts: Sequence[Action]) -> bool:
        if not all(self._action_ok(a) for a in acts):
            return False
        state = initial_state(self.alive, self.params.sets)
        for a in acts:
            state = apply_action(state, a)
            if state is None:
                return False
        return is_done(state)

    def _valid_completed(self) -> list:
        # valid by construction: found over live actions and survivors; _replan filters the older ones
        return list(self.completed.values())

    def _plan(self, acts, t, source) -> RingPlan:
        return RingPlan(self.alive, self.params.sets, self.total_bytes, tuple(acts), t, source,
                        self.measured.get(tuple(a.key() for a in acts)))


def plan(net, total_bytes: int, *, params: SearchParams | None = None, rng: random.Random,
         measure: Callable[[RingPlan], float] | None = None) -> RingPlan:
    """Run the full search (Ep episodes) and return the schedule to use.

    With ``measure`` (the real environment: seconds to all-reduce with a plan),
    the best ``top_k`` schedules are re-ranked by eq 13.
    """
    planner = RsgcmPlanner(net, total_bytes, params=params, rng=rng)
    planner.search()
    cands = planner.candidates()
    if not cands:
        return planner.fallback_plan()
    if measure is None:
        return cands[0]
    return rerank(cands, measure)


# ---------------------------------------------------------------- brute force (tests, small N)

def exhaustive_search(net, total_bytes: int, *, sets: int = 1, space: Sequence[Action] | None = None,
                      devices: Sequence[int] | None = None, max_steps: int | None = None,
                      extension: int = DEFAULT_EXTENSION, upper: int | None = None) -> RingPlan | None:
    """The optimum of the same space by depth-first branch and bound (for checking MCTS on small N)."""
    net = as_network(net)
    live = tuple(sorted(range(net.n) if devices is None else devices))
    sizes = block_sizes(int(total_bytes), sets)
    if space is None:
        space = build_search_space(net, sets=sets, devices=live, extension=extension, upper=upper,
                                   ref_bytes=sizes[0])
    cost = [_price(net, a, sizes) for a in space]
    st_max = max_steps or len(live)
    best_t, best_acts = math.inf, None
    seen: dict = {}

    def dfs(state, t, acts):
        nonlocal best_t, best_acts
        if is_done(state):
            if t < best_t:
                best_t, best_acts = t, tuple(acts)
            return
        if len(acts) >= st_max or t >= best_t:
            return
        key = _state_key(state)
        prev = seen.setdefault(key, [])
        if any(pt <= t and pd <= len(acts) for pt, pd in prev):
            return  # reached before no later and no deeper
        prev.append((t, len(acts)))
        for i, a in enumerate(space):
            nxt = apply_action(state, a)
            if nxt is not None:
                acts.append(a)
                dfs(nxt, t + cost[i], acts)
                acts.pop()

    dfs(initial_state(live, sets), 0.0, [])
    if best_acts is None:
        return None
    return RingPlan(live, sets, int(total_bytes), best_acts, best_t, "exhaustive")


# ---------------------------------------------------------------- compiling a plan into round programs

KIND_PARTIAL = 5  # ltp_ps.wire.KIND_PARTIAL (a partial aggregate between workers)
SCHEDULE_NAME = "rsgcm"
SLOT_MEAN = "mean"  # the role's mean buffer that Apply reads (as ltp_ps.schedules.ring)


def _element_ranges(lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    out, at = [], lo
    for size in block_sizes(hi - lo, parts):
        out.append((at, at + size))
        at += size
    return out


def _piece_grid(blk: tuple, sizes: Iterable[int]) -> list[tuple[int, int]]:
    """The common refinement of the chunkings of block ``blk`` by every ring size used on it."""
    cuts = {blk[0], blk[1]}
    for f in sizes:
        for lo, hi in _element_ranges(blk[0], blk[1], f):
            cuts.update((lo, hi))
    cuts = sorted(cuts)
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def _ring_stages(ring: Sequence[int], pos: int, s: int, blk: tuple, grid: Sequence[tuple], grid_base: int,
                 src: str, out: str, node_of, iteration: int, stride: int, timeout_s, rs_mode: str,
                 critical) -> list[list]:
    """The stages of one member (``ring[pos]``) of a ring all-reduce of block ``blk`` at RSGCM step ``s``.

    The ring cuts the block into ``f`` chunks; every chunk travels as the grid
    pieces it covers (pieces are the same in every step, so a slot always holds
    exactly the ranges the next step asks for).  Stage 0 copies the input into
    the step's output slot; reduce-scatter round ``t`` sends chunk
    ``(pos - t) mod f`` on (``rs_mode``) and merges chunk ``(pos - t - 1) mod f``
    from the predecessor (two stages: the next round sends what this one
    merged); all-gather round ``t`` sends chunk ``(pos + 1 - t) mod f`` and
    receives chunk ``(pos - t) mod f`` into the output slot (reliable: every
    member must end with the same values).
    """
    f = len(ring)
    nxt, prv = node_of(ring[(pos + 1) % f]), node_of(ring[(pos - 1) % f])
    chunks = _element_ranges(blk[0], blk[1], f)
    pieces = [[(grid_base + g, lo, hi) for g, (lo, hi) in enumerate(grid) if c0 <= lo and hi <= c1]
              for c0, c1 in chunks]
    stages: list[list] = [[Combine(out, src, lo, hi) for _, lo, hi in (p for c in pieces for p in c)]]
    for t in range(f - 1):
        step_no = s * stride + t
        cs, cr = (pos - t) % f, (pos - t - 1) % f
        slot = f"in:{SCHEDULE_NAME}:s{s}:t{t}:from{ring[(pos - 1) % f]}"
        io, merge = [], []
        for g, lo, hi in pieces[cs]:
            crit = critical(lo, hi) if rs_mode == TOLERANT else ()
            io.append(Send(nxt, out, lo, hi, pack_tag(iteration, PHASE_REDUCE_SCATTER, step_no, g, KIND_PARTIAL),
                           rs_mode, "partial", critical=crit, timeout_s=timeout_s, detach=True))
        for g, lo, hi in pieces[cr]:
            io.append(Recv(prv, slot, lo, hi, pack_tag(iteration, PHASE_REDUCE_SCATTER, step_no, g, KIND_PARTIAL),
                           rs_mode, "partial", timeout_s=timeout_s))
            merge.append(Combine(out, slot, lo, hi))
        stages.append(io)
        stages.append(merge)
    for t in range(f - 1):
        step_no = s * stride + t
        cs, cr = (pos + 1 - t) % f, (pos - t) % f
        io = []
        for g, lo, hi in pieces[cs]:
            io.append(Send(nxt, out, lo, hi, pack_tag(iteration, PHASE_ALL_GATHER, step_no, g, KIND_PARTIAL),
                           RELIABLE, "partial", timeout_s=timeout_s, detach=True))
        for g, lo, hi in pieces[cr]:
            io.append(Recv(prv, out, lo, hi, pack_tag(iteration, PHASE_ALL_GATHER, step_no, g, KIND_PARTIAL),
                           RELIABLE, "partial", timeout_s=timeout_s))
        stages.append(io)
    return stages


def _canonical_orientation(ring: Sequence[int], masks: Sequence[int]) -> tuple:
    """``ring`` rotated/reversed so that its members' contributor masks read lexicographically smallest.

    Rings of one step that add the same partials (e.g. the rows of a 2D-mesh's
    second step, each holding one partial per column) then add them in the same
    order from the same start for every chunk, so their floating-point sums are
    bit-identical.  Rotation and direction do not change the connections used.
    """
    f = len(ring)
    best, best_key = tuple(ring), None
    for order in (list(range(f)), list(range(f))[::-1]):
        for r in range(f):
            idx = order[r:] + order[:r]
            key = tuple(masks[i] for i in idx)
            if best_key is None or key < best_key:
                best, best_key = tuple(ring[i] for i in idx), key
    return best


def programs(ring_plan: RingPlan, n_elems: int, *, iteration: int, nodes: Mapping[int, str] | None = None,
             timeout_s: float | None = None, critical: Callable[[int, int], tuple] | None = None) -> RoundPlan:
    """Compile ``ring_plan`` into every worker's :class:`~ltp_ps.schedules.program.Program` for one round.

    Device ``d`` runs as node ``nodes[d]`` (default ``"worker:d"``).  Each
    program starts with ``Compute("acc")`` (the worker's gradient as a partial)
    and ends with an ``Adopt`` of every reduced piece and ``Apply("mean", 0,
    n_elems)`` (every worker runs its optimizer: ``apply_at="workers"``), the
    conventions of :mod:`ltp_ps.schedules.ring`.  The model's ``n_elems``
    elements are cut into ``ring_plan.blocks`` equal blocks; each step's rings
    run a reduce-scatter and a reliable all-gather on their block, reading the
    block from the slot the previous step that touched it wrote (first:
    ``acc``) and writing ``rsgcm:s<step>:b<block>``.  The rings of one step run
    concurrently (their stages are merged index by index).  ``critical(lo, hi)``
    gives the element ranges that must arrive in a loss-tolerant send.

    Loss tolerance: the reduce-scatter is loss-tolerant (lost elements leave the
    partial's counts, so the mean stays unbiased) only in the *first* step that
    reduces a block, and reliable afterwards.  After that first step the block's
    partial of each ring is identical on all its members (reliable all-gather),
    the rings partition the devices, and every later decomposition of "all
    devices" uses each of those partials exactly once (the state tensor forbids
    double counts) -- so every worker counts the same contributions.  A loss in
    a later step would reach only one ring's members and split the replicas.
    Every ring is oriented so its members' partials read in a canonical order
    (:func:`_canonical_orientation`): rings that add the same partials (a 2D-mesh
    or 2D-torus) produce bit-identical sums; rings that add the same partials in
    cyclic orders no rotation or reflection aligns agree up to float rounding
    (see docs/schedules.md).
    """
    if n_elems < 0:
        raise ValueError("n_elems must be >= 0")
    critical = critical or (lambda lo, hi: ())
    devices = list(ring_plan.devices)
    node_of = (lambda d: nodes[d]) if nodes is not None else worker_node
    stride = max(len(devices), 2)
    if len(ring_plan.steps) * stride - 1 > MAX_STEP:
        raise ValueError(f"{len(ring_plan.steps)} steps of rings up to {stride} devices do not fit the tag's step "
                         f"field (max {MAX_STEP}); plan with fewer steps (SearchParams.max_steps) or fewer devices")
    blocks = _element_ranges(0, int(n_elems), ring_plan.blocks)
    grids, base, at = [], [], 0
    for k, blk in enumerate(blocks):
        sizes = {len(r) for a in ring_plan.steps for rs in a.ring_sets if rs.block == k for r in rs.rings}
        grids.append(_piece_grid(blk, sizes))
        base.append(at)
        at += len(grids[-1])
    slot = {d: [SLOT_ACC] * ring_plan.blocks for d in devices}
    stages: dict = {d: [(Compute(SLOT_ACC),)] for d in devices}
    first_step: dict = {}
    for s, action in enumerate(ring_plan.steps):
        for rs in action.ring_sets:
            if rs.rings:
                first_step.setdefault(rs.block, s)
    state = initial_state(devices, ring_plan.blocks)
    for s, action in enumerate(ring_plan.steps):
        per_dev: dict = {}
        for rs in action.ring_sets:
            k = rs.block
            if blocks[k][1] <= blocks[k][0]:
                continue
            mode = TOLERANT if first_step[k] == s else RELIABLE
            out = f"{SCHEDULE_NAME}:s{s}:b{k}"
            for ring in rs.rings:
                ring = _canonical_orientation(ring, [state[d][k] for d in ring])
                for pos, d in enumerate(ring):
                    st = _ring_stages(ring, pos, s, blocks[k], grids[k], base[k], slot[d][k], out, node_of,
                                      iteration, stride, timeout_s, mode, critical)
                    per_dev.setdefault(d, []).append(st)
                    slot[d][k] = out
        nxt_state = apply_action(state, action)
        if nxt_state is None:
            raise ValueError(f"step {s} of the plan double-counts or adds nothing; it is not an RSGCM schedule")
        state = nxt_state
        for d, lists in per_dev.items():
            depth = max(len(x) for x in lists)
            for j in range(depth):
                merged = [step for x in lists if j < len(x) for step in x[j]]
                if merged:
                    stages[d].append(tuple(merged))
    for d in devices:
        final = [Adopt(slot[d][k], lo, hi) for k in range(len(blocks)) for lo, hi in grids[k]]
        stages[d].append(tuple(final) + (Apply(SLOT_MEAN, 0, int(n_elems)),))
    progs = {node_of(d): Program(node_of(d), tuple(stages[d])) for d in devices}
    notes = {"rsgcm": ring_plan.to_json(), "predicted_s": ring_plan.predicted_s}
    return RoundPlan(SCHEDULE_NAME, int(iteration), progs, APPLY_AT_WORKERS, notes)


# ---------------------------------------------------------------- the schedule (round planner over a World)

EPISODES_PER_ROUND = 64  # MCTS episodes run before each round while the budget lasts ("keep searching")
DEFAULT_SETS = 1  # S: one NIC per host (one send and one receive at a time), the lab's hosts


def price_plan(net: Network, ring_plan: RingPlan, total_bytes: int | None = None) -> float:
    """The virtual environment's time of ``ring_plan`` for ``total_bytes`` (default: the plan's own size)."""
    sizes = block_sizes(ring_plan.total_bytes if total_bytes is None else int(total_bytes), ring_plan.blocks)
    return sum(_price(net, a, sizes) for a in ring_plan.steps)


class RsgcmSchedule(Schedule):
    """``rsgcm``: RSGCM-planned ring schedules over the workers (no PS; every worker applies the optimizer).

    Built from the :class:`~ltp_ps.schedules.base.World`: worker ranks in order are
    devices ``0..N-1``; the network is the world's topology (host NICs and rack
    uplinks shared, failed pairs unconnected; a uniform one without a topology).
    The planner searches ``Ep`` episodes at construction, then
    ``episodes_per_round`` more before each round while the budget lasts (after a
    failure the budget restarts).  ``observe`` turns failed transfers into
    failures: a node whose every reported transfer failed (at least two peers)
    is a failed device, any other failed pair a failed link; meanwhile the best
    valid schedule (else a ring of the survivors) runs, so no round is lost.
    ``observe_round(seconds)`` is the real environment: the measured all-reduce
    time of the plan the last round ran; the top ``TOP_CANDIDATES`` plans are
    each run once and the best by eq 13 is kept.  Measurements differ between
    processes, so a job that feeds them must let its coordinator distribute the
    plans (``RoundPlan.to_json``), as the layer does for every adaptive planner.
    """

    name = SCHEDULE_NAME
    apply_at = APPLY_AT_WORKERS
    needs_servers = False

    def __init__(self, world, *, rng: random.Random | None = None, sets: int = DEFAULT_SETS,
                 params: SearchParams | None = None, episodes_per_round: int = EPISODES_PER_ROUND,
                 edge_elems: int = 1, max_critical_ranges: int = 120):
        super().__init__(world, rng=rng)
        self.params = params or SearchParams(sets=sets)
        self.episodes_per_round = int(episodes_per_round)
        self.edge_elems = edge_elems
        self.max_critical_ranges = max_critical_ranges
        self._last: RingPlan | None = None
        self._build()

    def _build(self) -> None:
        w = self.world
        self.ranks = list(w.workers)
        self.nodes = [worker_node(r) for r in self.ranks]
        self.index = {nd: i for i, nd in enumerate(self.nodes)}
        topo = w.effective_topology()
        self.net = as_network(topo, names=self.nodes)
        self.planner = RsgcmPlanner(self.net, 4 * int(w.n_elems), params=self.params, rng=self.rng)
        self.planner.search()

    def _critical(self, lo: int, hi: int) -> tuple:
        if not self.world.layout:
            return ()
        from ..aggregate import critical_ranges

        byte = critical_ranges(self.world.layout, header_bytes=0, shard=(lo, hi), edge_elems=self.edge_elems,
                               max_ranges=self.max_critical_ranges)
        return tuple((lo + a // 4, lo + -(-b // 4)) for a, b in byte)

    def current(self) -> RingPlan:
        """The RSGCM plan the next round will run."""
        return self.planner.next_to_measure() or self.planner.current_plan()

    def plan(self, iteration: int):
        """Every worker's program for round ``iteration`` (searching a little more first, while budget lasts)."""
        if self.planner.budget_left:
            self.planner.search(self.episodes_per_round)
        self._last = self.current()
        rp = programs(self._last, self.world.n_elems, iteration=iteration,
                      nodes={i: nd for i, nd in enumerate(self.nodes)}, critical=self._critical)
        return rp

    def observe(self, reports: Sequence) -> None:
        """Link reports of the last round: failed transfers become failed links or devices."""
        failed_pairs, ok_nodes, bad_peers = set(), set(), {}
        for r in reports:
            if r.src not in self.index or r.dst not in self.index:
                continue
            if r.ok:
                ok_nodes.update((r.src, r.dst))
                continue
            failed_pairs.add(frozenset((r.src, r.dst)))
            bad_peers.setdefault(r.src, set()).add(r.dst)
            bad_peers.setdefault(r.dst, set()).add(r.src)
        dead = {nd for nd, peers in bad_peers.items() if len(peers) >= 2 and nd not in ok_nodes}
        for nd in sorted(dead):
            if self.index[nd] not in self.planner.failed_devices:
                self.planner.fail_device(self.index[nd])
        for pair in sorted(failed_pairs, key=sorted):
            a, b = sorted(pair)
            if a in dead or b in dead:
                continue
            if _pair(self.index[a], self.index[b]) not in self.planner.failed_links:
                self.planner.fail_link(self.index[a], self.index[b])

    def observe_round(self, seconds: float) -> None:
        """The measured all-reduce time of the plan the last round ran (the real environment, eq 13)."""
        if self._last is not None and self._last.source != "fallback":
            self.planner.record_measurement(self._last, seconds)

    def controller(self):
        return None

    def predict_s(self, nbytes: int | None = None) -> float | None:
        """The cost model's time of the plan the next round runs (for ``nbytes`` per worker if given)."""
        return price_plan(self.planner._live_net(), self.current(), nbytes)

    def set_world(self, world) -> None:
        """The world changed.  Departed workers are failed devices; a new topology (measured rates, failed
        pairs) reprices the search and keeps searching; new workers or a new model size plan from scratch."""
        gone = set(self.ranks) - set(world.workers)
        if set(world.workers) <= set(self.ranks) and world.n_elems == self.world.n_elems:
            old = self.world
            self.world = world
            if (world.topology, dict(world.placement)) != (old.topology, dict(old.placement)):
                full = dataclasses.replace(world, workers=tuple(self.ranks))  # device numbering stays
                self.net = as_network(full.effective_topology(), names=self.nodes)
                self.planner.update_network(self.net)
            for r in sorted(gone):
                d = self.ranks.index(r)
                if d not in self.planner.failed_devices:
                    self.planner.fail_device(d)
            return
        self.world = world
        self._build()


SCHEDULE = RsgcmSchedule
