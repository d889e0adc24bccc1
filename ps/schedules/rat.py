"""RAT: resilient all-reduce trees built from the topology (Wan, Hu, Zhang, ZTE Tech. J. 2020).

Theory of operation
-------------------
The paper (in Chinese; what we use, translated) argues from two costs:

* **PS cross-rack load (§2.1).**  With a PS shard colocated on every server,
  each server pushes ``1/w`` of its gradient to every other server, so a rack
  uplink carries ``(w/r)(1 - 1/r) S`` while a host link carries
  ``(w-1)/w S`` -- for the paper's Fig 3 (2 racks x 4) that is 2.29x, "about
  1.3x more" load on the cross-rack link.  With oversubscription ``o`` (uplink
  = rack's host capacity / ``o``) the round slows by the uplink/host time
  ratio, see :func:`ps_oversubscription_slowdown`.
* **Ring chain blocking (§2.2).**  If node 1 cannot send, node 2 can forward
  only the one chunk it owns, node 3 two, ...: hop ``i`` runs at ``i/n`` of
  its rate and, for large ``n``, half the network sits idle
  (:func:`ring_chain_blocking`).

RAT keeps cross-region traffic minimal *and* the dependency chain short:

* **One tree (§3.2).**  Every rack (oversubscribed region of level 0) gets a
  level-0 aggregator that sums its rack; every region one level up picks a
  level-1 aggregator among its level-0 aggregators, and so on to the root.
  The broadcast runs the same tree in reverse.  The longest dependency chain
  is ``2(l + 1)`` transfers for ``l`` oversubscribed levels (Table 1: PS 2,
  ring ``2(w-1)``).
* **n trees (§4.2).**  One tree rooted at every node, the model split into
  ``n`` slices, slice ``k`` reduced and broadcast along tree ``k``, so every
  node is a root once and the load is balanced.

Choices the paper leaves open (also in ``docs/schedules.md``):

1. In tree ``k`` a region's aggregator is the root if the root is in that
   region, else its child at local index ``k mod |children|`` (for a rack:
   the host at local index ``k mod |rack|``).  With equal racks every host is
   then a non-root aggregator in exactly one tree per other region.
2. Asymmetric links: slice ``k`` is proportional to root ``k``'s rate
   (:func:`slice_sizes`; the paper leaves this to future work).
3. In the parameter server (``--schedule rat``), tree ``k`` is rooted at PS
   shard ``k``; with ``--num-servers K --colocate`` shard ``k`` sits on worker
   ``k``'s host, so tree ``k``'s root is worker ``k``'s host and worker ``k``
   hands its slice to the shard over loopback.  With fewer shards than
   workers there are ``K`` trees (the first ``K`` roots).
4. Aggregators are store-and-forward per slice (an aggregator sends up once
   it has every child's partial or the round's deadline has written a child
   off); partials carry per-element contributor counts
   (:mod:`ltp_ps.schedules.partial`) so the root's mean is the direct PS's
   unbiased mean.

Everything here is pure: plain data in, trees/programs/flows out.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Hashable, Mapping, Sequence

from .base import Schedule, World
from .fluid import Flow
from .program import (APPLY_AT_SERVER, RELIABLE, SLOT_ACC, SLOT_GRAD, SLOT_PARAMS, TOLERANT, Apply, Combine, Compute,
                      Forward, Program, Recv, RoundPlan, Send, server)
from .tags import MAX_STEP, PHASE_PULL, PHASE_PUSH, pack

__all__ = [
    "RatTree", "build_tree", "rat_trees", "regions_of", "slice_sizes", "rat_flows", "cross_region_bytes",
    "ps_uplink_load_ratio", "ps_oversubscription_slowdown", "paper_ps_slowdown_formula", "ring_chain_blocking",
    "dependency_chain_length", "RatSchedule",
]

KIND_GRAD = 1  # ltp_ps.wire.KIND_GRAD (a leaf's own gradient)
KIND_PARAMS = 2  # ltp_ps.wire.KIND_PARAMS
KIND_PARTIAL = 5  # ltp_ps.wire.KIND_PARTIAL (an aggregator's partial)


# --------------------------------------------------------------------------- cost-model argument (§2)

def ps_uplink_load_ratio(w: int, r: int) -> float:
    """Bytes on a rack uplink / bytes on a host link for a colocated PS round (§2.1), racks of ``w/r``.

    Fig 3 (w=8, r=2): 2.29, the paper's "about 1.3x more" load on the cross-rack link."""
    if w < 2 or r < 1 or w % r:
        raise ValueError(f"need w >= 2 workers in r equal racks, got w={w}, r={r}")
    return (w / r) * (1 - 1 / r) / ((w - 1) / w)


def ps_oversubscription_slowdown(o: float, w: int, r: int) -> float:
    """A colocated PS round's time on an ``o:1`` oversubscribed fabric over its time on a non-blocking one.

    The uplink (capacity ``(w/r) B / o``) needs ``o (1 - 1/r) S / B``; each host link ``(w-1)/w S / B``;
    the round takes the larger: ``max(1, o w (1 - 1/r) / (w - 1))``.  This is the load ratio above scaled
    by ``o / (w/r)``; the fluid simulator reproduces it (``tests/test_rat.py``)."""
    return max(1.0, o * w * (1 - 1 / r) / (w - 1))


def paper_ps_slowdown_formula(o: float, w: int, r: int) -> float:
    """The expression printed in §2.1, ``o (w-1) / (w (1 - 1/r))``, kept for comparison.

    It inverts the ``w (1-1/r)/(w-1)`` factor of :func:`ps_oversubscription_slowdown` (for Fig 3 at
    ``o = 1`` it predicts 1.75x where the uplink is not even the bottleneck); both grow linearly in ``o``."""
    return o * (w - 1) / (w * (1 - 1 / r))


def ring_chain_blocking(n: int) -> tuple[list[float], float]:
    """§2.2: node 1 blocked; hop ``i -> i+1`` (i = 2..n) can only forward ``(i-1)/n`` of its data.

    Returns the per-hop usable fractions of the ``n - 1`` downstream hops and their mean, which tends to
    1/2 (the paper's "50% lower network utilisation") as ``n`` grows."""
    if n < 2:
        raise ValueError("a ring needs n >= 2 nodes")
    fr = [i / n for i in range(1, n)]
    return fr, sum(fr) / len(fr)


def dependency_chain_length(scheme: str, *, w: int = 0, levels: int = 1, w_r: int = 0, k: int = 2) -> float:
    """Table 1: the longest chain of dependent transfers per round."""
    table = {
        "ps": lambda: 2,
        "ring": lambda: 2 * (w - 1),
        "butterfly": lambda: math.log2(w),
        "halving_doubling": lambda: 2 * math.log2(w),
        "k_nomial": lambda: 2 * math.log(w, k),
        "blueconnect": lambda: 2 * (levels + w_r),
        "plink": lambda: 4,
        "rat": lambda: 2 * (levels + 1),
    }
    if scheme not in table:
        raise ValueError(f"unknown scheme {scheme!r}; one of {sorted(table)}")
    return table[scheme]()


# --------------------------------------------------------------------------- trees (§3.2, §4.2)

@dataclasses.dataclass(frozen=True)
class RatTree:
    """Tree ``index``: ``parent[node]`` and the level of that edge (0: leaf -> rack aggregator,
    ``h``: aggregator of a height-``h-1`` region -> aggregator of its height-``h`` region)."""

    index: int
    root: Hashable
    parent: Mapping  # node -> parent node (every node but the root and self-aggregating members)
    edge_level: Mapping  # node -> level of its edge to its parent
    aggregator: Mapping  # region path (tuple of indices) -> aggregator node
    levels: int  # l: oversubscribed levels (height of the hierarchy)

    def edges(self) -> list[tuple]:
        """``(child, parent, level)`` of the reduce direction, leaves first."""
        return sorted(((c, p, self.edge_level[c]) for c, p in self.parent.items()), key=lambda e: (e[2], str(e[0])))

    def children(self, node) -> list:
        return [c for c, p in self.parent.items() if p == node]

    def depth(self, node) -> int:
        d = 0
        while node in self.parent:
            node = self.parent[node]
            d += 1
        return d

    def chain_length(self) -> int:
        """Longest dependency chain of one round on this tree: reduce hops + broadcast hops."""
        return 2 * max((self.depth(n) for n in self.parent), default=0)

    def non_root_aggregators(self) -> set:
        return {p for p in self.parent.values() if p != self.root}


def _height(region) -> int:
    if isinstance(region, (str, int)) or not isinstance(region, Sequence):
        return -1
    hs = {_height(c) for c in region}
    if len(hs) != 1:
        raise ValueError("RAT needs a balanced hierarchy: every rack at the same depth "
                         "(wrap a lone rack in a list to lift it)")
    return hs.pop() + 1


def _members(region) -> list:
    if _height(region) < 0:
        return [region]
    return [m for c in region for m in _members(c)]


def _path_of(region, member, path=()) -> tuple | None:
    if _height(region) < 0:
        return path if region == member else None
    for i, c in enumerate(region):
        p = _path_of(c, member, path + (i,))
        if p is not None:
            return p
    return None


def build_tree(regions, k: int, root: Hashable, root_path: tuple | None = None) -> RatTree:
    """RAT tree ``k`` over ``regions`` (a nested list: a list of members is a rack, a list of racks a
    region of height 1, ...), rooted at ``root``.

    ``root`` may be a member (its path is found) or an outside node placed by ``root_path`` (indices of
    the region it hangs off; ``()``: the top, i.e. outside every rack)."""
    top_h = _height(regions)
    if top_h < 0:
        raise ValueError("regions must be a (nested) list of members")
    if root_path is None:
        root_path = _path_of(regions, root)
        if root_path is None:
            raise ValueError(f"root {root!r} is not a member; give root_path for an outside root")
        root_path = root_path[:-1]  # the rack holding it
    parent, level, agg = {}, {}, {}

    def visit(region, path, h):
        """Aggregator of ``region`` (height h); records edges below it."""
        on_root_path = root_path[:len(path)] == path
        if h == 0:  # a rack: members -> aggregator
            members = list(region)
            if not members:
                raise ValueError(f"empty rack at {path}")
            a = root if on_root_path else members[k % len(members)]
            for m in members:
                if m != a:
                    parent[m], level[m] = a, 0
            agg[path] = a
            return a
        if not region:
            raise ValueError(f"empty region at {path}")
        child_aggs = [visit(c, path + (i,), h - 1) for i, c in enumerate(region)]
        a = root if on_root_path else child_aggs[k % len(child_aggs)]
        for c in child_aggs:
            if c != a:
                parent[c], level[c] = a, h
        agg[path] = a
        return a

    top = visit(regions, (), top_h)
    if top != root:  # the root sits outside every rack (root_path == ()) and the top region chose a member
        raise AssertionError("unreachable: the top region's aggregator is always the root")
    return RatTree(k, root, parent, level, agg, top_h)


def rat_trees(regions, roots: Sequence | None = None) -> list[RatTree]:
    """One tree per root (default: every member, in order, so every node is a root once -- §4.2)."""
    roots = _members(regions) if roots is None else list(roots)
    return [build_tree(regions, k, r) for k, r in enumerate(roots)]


def regions_of(topology, nodes: Sequence | None = None) -> list:
    """A ``Topology``'s racks as RAT regions (``[[host, ...], ...]``, racks in id order), or plain data
    passed through.  One rack gives ``[[hosts]]`` (l = 1 with a single region: the root aggregates it)."""
    if isinstance(topology, (list, tuple)):
        return list(topology)
    racks = topology.racks()
    keep = None if nodes is None else set(nodes)
    out = [[h for h in racks[r] if keep is None or h in keep] for r in sorted(racks)]
    return [r for r in out if r]


def slice_sizes(total: int, rates: Sequence[float] | None = None, n: int | None = None) -> list[int]:
    """Split ``total`` elements into slices proportional to ``rates`` (equal if None), summing to ``total``."""
    if rates is None:
        rates = [1.0] * int(n)
    if not rates or any(r <= 0 for r in rates):
        raise ValueError("slice rates must be > 0")
    s = sum(rates)
    bounds = [round(total * sum(rates[:i]) / s) for i in range(len(rates) + 1)]
    return [bounds[i + 1] - bounds[i] for i in range(len(rates))]


def cross_region_bytes(trees: Sequence[RatTree], slice_bytes: Sequence[float], rack_of: Mapping) -> dict:
    """Bytes each rack sends out and receives over its uplink in one round (reduce + broadcast)."""
    out: dict = {}
    for t, b in zip(trees, slice_bytes):
        for c, p, _ in t.edges():
            rc, rp = rack_of.get(c), rack_of.get(p)
            if rc != rp:
                for key, rr in (("up", rc), ("down", rp)):  # reduce c -> p
                    out.setdefault(rr, {"up": 0.0, "down": 0.0})[key] += b
                for key, rr in (("up", rp), ("down", rc)):  # broadcast p -> c
                    out.setdefault(rr, {"up": 0.0, "down": 0.0})[key] += b
    return out


def rat_flows(trees: Sequence[RatTree], slice_bytes: Sequence[float], host_of: Mapping | None = None, *,
              chunks: int = 1, down_chunks: int | None = None, prefix: str = "rat") -> list[Flow]:
    """The round as fluid flows.  Per tree, the slice is cut into ``chunks`` pieces sent in order on every
    edge; an aggregator sends piece ``j`` up once piece ``j`` of all its children arrived (cut-through per
    piece; ``chunks=1`` is store-and-forward).  The broadcast uses ``down_chunks`` pieces (default:
    ``chunks``); it starts once the root has reduced the matching piece (all pieces if the two differ),
    and every node forwards a piece as soon as it has it, to its children of the higher levels first
    (the broadcast runs the levels in reverse, §3.2)."""
    if chunks < 1 or (down_chunks is not None and down_chunks < 1):
        raise ValueError("chunks must be >= 1")
    down_chunks = chunks if down_chunks is None else down_chunks
    host = (lambda n: n) if host_of is None else (lambda n: host_of[n])
    flows = []
    for t, b in zip(trees, slice_bytes):
        kids: dict = {}
        for c, p, _ in t.edges():
            kids.setdefault(p, []).append(c)
        for j in range(chunks):
            for c, p, _ in t.edges():
                flows.append(Flow((prefix, t.index, "up", c, j), host(c), host(p), b / chunks,
                                  after=[(prefix, t.index, "up", g, j) for g in kids.get(c, ())],
                                  after_sent=[(prefix, t.index, "up", c, j - 1)] if j else []))
        for j in range(down_chunks):
            same = down_chunks == chunks
            for c, p, e in t.edges():
                if p in t.parent:
                    after = [(prefix, t.index, "down", p, j)]
                else:
                    after = [(prefix, t.index, "up", g, jj) for g in kids.get(p, ())
                             for jj in ([j] if same else range(chunks))]
                higher = [(prefix, t.index, "down", g, j) for g in kids.get(p, ()) if t.edge_level[g] > e]
                flows.append(Flow((prefix, t.index, "down", c, j), host(p), host(c), b / down_chunks, after=after,
                                  after_sent=higher + ([(prefix, t.index, "down", c, j - 1)] if j else [])))
    return flows


# --------------------------------------------------------------------------- the schedule

def params_slot(shard: int) -> str:
    """Where a worker receives (and an aggregator forwards) shard ``shard``'s parameters (as ``direct``)."""
    return f"{SLOT_PARAMS}:{server(shard)}"


class RatSchedule(Schedule):
    """``--schedule rat``: one RAT tree per PS shard, rooted at the shard, reducing the shard's slice.

    Leaves send their gradient slice (tolerant), aggregators merge partials and send them up (tolerant,
    store-and-forward), the root shard applies the optimizer, and the parameters run the tree in reverse
    (reliable).  Stages are ordered by edge level so no node waits on a later stage of another node."""

    name = "rat"
    apply_at = APPLY_AT_SERVER

    def __init__(self, world: World, *, rng=None, chunks: int = 1):
        super().__init__(world, rng=rng)
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1 (pieces per tree slice in the reduce), got {chunks}")
        self.chunks = int(chunks)
        self._trees = self._build()

    def set_world(self, world: World) -> None:
        super().set_world(world)
        self._trees = self._build()

    def trees(self) -> list[RatTree]:
        return list(self._trees)

    def _build(self) -> list[RatTree]:
        w = self.world
        nodes = w.worker_nodes
        topo = w.topology
        if topo is None:
            regions = [nodes]
        else:
            by_rack: dict = {}
            for n in nodes:
                by_rack.setdefault(topo.rack_of(w.host_of(n)), []).append(n)
            regions = [by_rack[r] for r in sorted(by_rack)]
        regions = [regions] if _height(regions) == 0 else regions  # a flat list is one rack
        trees = []
        for k in range(len(w.shards)):
            s = server(k)
            path = self._root_path(regions, s)
            trees.append(build_tree(regions, k, s, root_path=path))
        return trees

    def _root_path(self, regions, s) -> tuple:
        """Where shard ``s`` hangs: the rack of a worker on its host (colocated), else its host's rack, else
        the top (outside every rack)."""
        w = self.world
        try:
            h = w.host_of(s)
        except KeyError:
            return ()
        for n in _members(regions):
            try:
                if w.host_of(n) == h:
                    return _path_of(regions, n)[:-1]
            except KeyError:
                continue
        if w.topology is not None and h in w.topology.names:
            rk = w.topology.rack_of(h)
            for i, rack in enumerate(regions):
                if rack and w.topology.rack_of(w.host_of(_members(rack)[0])) == rk:
                    return (i,) if _height(regions) == 1 else _path_of(regions, _members(rack)[0])[:-1]
        return ()

    def plan(self, iteration: int) -> RoundPlan:
        """Round ``iteration``, in the layer's round shape (as ``direct``): parameters down every tree
        (top level first), ``Compute``, partials up every tree (level 0 first), the root shard's ``Apply``.

        Stage layout with ``L`` levels: ``L - e`` = level-``e`` broadcast transfers, ``L + 1`` = Compute,
        then for every piece ``j`` of the slice (``chunks``, default 1) and level ``e``: ``L + 2 + 2q`` =
        the reduce transfers and ``L + 3 + 2q`` their Combines, ``q = j (L + 1) + e``; last, the root's
        ``Apply`` per piece.  A transfer and its receive share a stage index, and every step depends only
        on earlier stages (lexicographic in ``(j, e)``) of its own node, so no two nodes wait on each
        other.  With ``chunks > 1`` aggregators are cut-through: piece ``j`` goes up while the leaves
        already send piece ``j + 1``."""
        stages: dict = {}  # node -> {stage index: [steps]}
        L = max((t.levels for t in self._trees), default=1)

        def add(node, st, step):
            stages.setdefault(node, {}).setdefault(st, []).append(step)

        for t, (lo, hi) in zip(self._trees, self.world.shards):
            if hi <= lo:
                continue
            k = t.index
            kids: dict = {}
            for c, p, e in t.edges():
                kids.setdefault(p, []).append((c, e))
            pslot = params_slot(k)
            n_pieces = max(1, min(self.chunks, hi - lo))
            if n_pieces * (L + 1) > MAX_STEP + 1:
                raise ValueError(f"rat: {n_pieces} pieces per slice on trees of {L} levels need "
                                 f"{n_pieces * (L + 1)} tag steps, more than {MAX_STEP + 1}; use at most "
                                 f"{(MAX_STEP + 1) // (L + 1)} chunks")
            bounds = [lo + (hi - lo) * j // n_pieces for j in range(n_pieces + 1)]
            pieces = list(zip(bounds[:-1], bounds[1:]))
            for c, p, e in t.edges():
                down_tag = pack(iteration, PHASE_PULL, e, k, KIND_PARAMS)
                if p == t.root:
                    add(p, L - e, Send(c, SLOT_PARAMS, lo, hi, down_tag, RELIABLE, "params", group=f"down:{k}:{e}"))
                else:
                    add(p, L - e, Forward(c, pslot, lo, hi, down_tag, RELIABLE, "params", group=f"down:{k}:{e}"))
                add(c, L - e, Recv(p, pslot, lo, hi, down_tag, RELIABLE, "params", group="params"))
            for j, (a, b) in enumerate(pieces):
                for c, p, e in t.edges():
                    q = j * (L + 1) + e
                    up_tag = pack(iteration, PHASE_PUSH, q, k, KIND_PARTIAL)
                    src_slot = SLOT_ACC if c in kids else SLOT_GRAD
                    add(c, L + 2 + 2 * q, Send(p, src_slot, a, b, up_tag, TOLERANT, "partial"))
                    slot = f"in:{c}:{k}" if len(pieces) == 1 else f"in:{c}:{k}:{j}"
                    group = f"rat:{k}:{e}" if len(pieces) == 1 else f"rat:{k}:{j}:{e}"
                    # only from a child its parameter hop reached: a stalled child must not make its parent late
                    add(p, L + 2 + 2 * q, Recv(c, slot, a, b, up_tag, TOLERANT, "partial", group=group,
                                               only_if=f"down:{k}:{e}"))
                    add(p, L + 3 + 2 * q, Combine(SLOT_ACC, slot, a, b))
                for p in kids:  # an aggregating worker adds its own gradient before its children's partials
                    if p != t.root:
                        first = j * (L + 1) + min(e for _, e in kids[p])
                        stages[p].setdefault(L + 3 + 2 * first, []).insert(0, Combine(SLOT_ACC, SLOT_GRAD, a, b))
                add(t.root, L + 2 + 2 * len(pieces) * (L + 1), Apply(SLOT_ACC, a, b))
        for n in self.world.worker_nodes:
            add(n, L + 1, Compute())
        programs = {n: Program(n, tuple(tuple(v[i]) for i in sorted(v))) for n, v in stages.items()}
        notes = {"trees": [{"index": t.index, "root": t.root,
                            "edges": [[c, p, e] for c, p, e in t.edges()]} for t in self._trees],
                 "chain_length": max((t.chain_length() for t in self._trees), default=0), "levels": L}
        return RoundPlan(self.name, iteration, programs, self.apply_at, notes)

    def flows(self, nbytes_per_elem: int = 4) -> list[Flow]:
        """This world's round as fluid flows (nodes mapped to topology hosts)."""
        hosts = {n: self.world.host_of(n) for t in self._trees for e in t.edges() for n in e[:2]}
        sizes = [(hi - lo) * nbytes_per_elem for lo, hi in self.world.shards]
        return rat_flows(self._trees, sizes, hosts, chunks=self.chunks, down_chunks=1)  # as compiled

    def predict_s(self, nbytes: int | None = None) -> float | None:
        from .fluid import FluidNetwork, simulate
        if self.world.topology is None:
            return None
        scale = 1.0 if nbytes is None else nbytes / max(1, 4 * self.world.n_elems)
        flows = [dataclasses.replace(f, nbytes=f.nbytes * scale) for f in self.flows()]
        return simulate(FluidNetwork.from_topology(self.world.topology), flows).completion_s


SCHEDULE = RatSchedule
