"""A max-min-fair fluid (flow-level) simulator for aggregation schedules.

Theory of operation
-------------------
A schedule's round is a DAG of *flows* ``(src, dst, nbytes, after=[...])``.  The
network is a two-tier datacenter: every host has an up link (NIC egress) and a
down link (NIC ingress); every rack has an uplink (ToR -> core) and a downlink
(core -> ToR) whose rates encode the oversubscription ratio.  A flow between
two racks crosses ``host_up(src), rack_up(rack(src)), rack_down(rack(dst)),
host_down(dst)``; a flow inside a rack crosses the two host links only; a flow
from a host to itself (a colocated PS shard) costs nothing.  Multipath core
fabrics (2 spines) are modelled as one aggregate rack link, i.e. perfect ECMP.

Rates are the max-min fair allocation computed by *progressive filling*: all
unfrozen flows rise together; when a link saturates, the flows crossing it
freeze.  The allocation is piecewise constant between *events*: a flow starts
(its dependencies finished), a flow's last byte is sent, a streamed flow
catches up with its upstream, or the set of paused hosts changes.  Between
events every flow advances linearly, so the simulation is exact for the fluid
model (no time step).

Invariants (property-tested):

1. no link carries more than its capacity;
2. work conserving: every flow with a positive demand is either bottlenecked
   by a saturated link on its path or capped by its upstream (streams);
3. a flow never starts before every flow in its ``after`` list finished.

Latency.  A flow is *finished* one propagation latency (``latency_s``) after
its last byte left, so a store-and-forward chain of ``h`` hops of ``S`` bytes
costs ``h (S/B + L)``.  A *streamed* flow (``stream_from=g``, used for
pipelined chains: Hoplite's reduce chain and partial-copy broadcast, RAT's
cut-through aggregators) starts ``latency_s`` after its upstream started and
never delivers more bytes than its upstream has; a pipelined chain of ``h``
hops therefore costs ``S/B + h L`` (Hoplite App. A: ``S/B + (n-1) L`` for
``n - 1`` hops).  The lag of one latency is applied at the start only: once a
stream has caught up it is capped at its upstream's rate without delay (a
deliberate simplification, exact while rates are steady).

Pauses.  A paused host sends nothing (its up link has capacity 0), which is
how the RAT paper (§4.1) emulates congested or failed nodes: ``k`` hosts,
redrawn every ``d`` seconds (:class:`RotatingPauses`, seeded).  A plan with
``rate_bps > 0`` throttles instead of stopping (the lab's 1 Mbit/s egress).

The simulator is pure: no clock, no I/O; randomness only through a
``random.Random`` handed to :class:`RotatingPauses`.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Hashable, Iterable, Mapping, Protocol, Sequence

import numpy as np

__all__ = [
    "Flow", "FluidNetwork", "FluidResult", "PausePlan", "NoPauses", "StaticPauses", "RotatingPauses",
    "allocate", "simulate", "DeadlockError", "ps_flows", "ring_flows",
]

BITS_PER_BYTE = 8
REL_EPS = 1e-9  # relative tolerance for "same instant" / "link saturated"
ABS_BYTES_EPS = 1e-6  # bytes: a flow with less than this left is done


class DeadlockError(RuntimeError):
    """The flows cannot all finish: a dependency cycle, a missing dependency, or a host paused forever."""


@dataclasses.dataclass(frozen=True)
class Flow:
    """One transfer of a round.

    ``after``: names of flows whose completion (last byte + latency) this flow
    waits for; ``after_sent``: flows whose last byte must have left their
    sender (a sender's chunks in order, pipelined without a latency gap).  ``stream_from``: name of a flow of the same size this one is
    pipelined behind (it starts one latency after that flow starts and never
    overtakes it).  ``delay_s``: extra time between readiness and start (e.g.
    compute or a partial aggregation step).
    """

    name: Hashable
    src: str
    dst: str
    nbytes: float
    after: tuple = ()
    stream_from: Hashable | None = None
    delay_s: float = 0.0
    after_sent: tuple = ()  # flows whose last byte must have *left* (sender-side order, no latency)
    not_before_s: float = 0.0  # seconds: absolute earliest start (a node that becomes ready late)

    def __post_init__(self):
        if self.nbytes < 0 or not math.isfinite(self.nbytes):
            raise ValueError(f"flow {self.name!r}: nbytes must be finite and >= 0, got {self.nbytes}")
        if self.delay_s < 0:
            raise ValueError(f"flow {self.name!r}: delay_s must be >= 0")
        object.__setattr__(self, "after", tuple(self.after))
        object.__setattr__(self, "after_sent", tuple(self.after_sent))


@dataclasses.dataclass
class FluidNetwork:
    """Link capacities of a two-tier network, in bits per second.

    A host absent from ``rack_of`` sits in no rack (no rack links); a rack
    absent from ``rack_up_bps``/``rack_down_bps`` has an unlimited link.
    """

    host_up_bps: Mapping[str, float]
    host_down_bps: Mapping[str, float]
    rack_of: Mapping[str, str] = dataclasses.field(default_factory=dict)
    rack_up_bps: Mapping[str, float] = dataclasses.field(default_factory=dict)
    rack_down_bps: Mapping[str, float] = dataclasses.field(default_factory=dict)
    latency_s: float = 0.0

    @classmethod
    def uniform(cls, racks: Sequence[Sequence[str]] | Sequence[int], host_bps: float, *,
                oversubscription: float = 1.0, uplink_bps: float | None = None,
                latency_s: float = 0.0) -> "FluidNetwork":
        """Racks of hosts at ``host_bps``; each rack's uplink/downlink is
        ``sum(host rates)/oversubscription`` unless ``uplink_bps`` is given.
        ``racks`` may be rack sizes (hosts named ``h0, h1, ...`` in rack order)."""
        if racks and isinstance(racks[0], int):
            names, i = [], 0
            for size in racks:
                names.append([f"h{i + j}" for j in range(size)])
                i += size
            racks = names
        if oversubscription <= 0:
            raise ValueError("oversubscription must be > 0 (1.0 = none)")
        up, rack_of, rup = {}, {}, {}
        for r, hosts in enumerate(racks):
            for h in hosts:
                if h in up:
                    raise ValueError(f"host {h!r} is in two racks")
                up[h] = float(host_bps)
                rack_of[h] = f"r{r}"
            rup[f"r{r}"] = float(uplink_bps) if uplink_bps is not None else len(hosts) * host_bps / oversubscription
        return cls(dict(up), dict(up), rack_of, rup, dict(rup), latency_s)

    @classmethod
    def from_topology(cls, topology) -> "FluidNetwork":
        """Build from a schedule-layer ``Topology`` (duck-typed: ``hosts``, ``racks``,
        per-host ``up_bps``/``down_bps``, ``uplink_bps`` per rack, ``latency_s``)."""
        return _from_topology(cls, topology)

    @property
    def hosts(self) -> list[str]:
        return list(self.host_up_bps)

    def links_of(self, src: str, dst: str) -> list[tuple]:
        """The links a flow from ``src`` to ``dst`` crosses (empty on the same host)."""
        for h in (src, dst):
            if h not in self.host_up_bps or h not in self.host_down_bps:
                raise ValueError(f"unknown host {h!r}; known: {sorted(self.host_up_bps)[:8]}...")
        if src == dst:
            return []
        links = [("up", src)]
        rs, rd = self.rack_of.get(src), self.rack_of.get(dst)
        if rs != rd:
            if rs is not None and rs in self.rack_up_bps:
                links.append(("rack_up", rs))
            if rd is not None and rd in self.rack_down_bps:
                links.append(("rack_down", rd))
        links.append(("down", dst))
        return links

    def capacity_Bps(self, link: tuple, paused: frozenset = frozenset(), paused_bps: float = 0.0) -> float:
        """Capacity in bytes/s; a paused host's up link runs at ``paused_bps`` (0: stopped)."""
        kind, who = link
        if kind == "up":
            return min(paused_bps, self.host_up_bps[who]) / BITS_PER_BYTE if who in paused \
                else self.host_up_bps[who] / BITS_PER_BYTE
        if kind == "down":
            return self.host_down_bps[who] / BITS_PER_BYTE
        if kind == "rack_up":
            return self.rack_up_bps[who] / BITS_PER_BYTE
        return self.rack_down_bps[who] / BITS_PER_BYTE


def _from_topology(cls, topo) -> FluidNetwork:
    """``ltp_ps.schedules.topology.Topology`` -> network: host rates, racks, uplinks; latency = the largest
    host-to-host one-way latency (the fluid model has one latency for every hop)."""
    up = {h.name: float(h.up_bps) for h in topo.hosts}
    down = {h.name: float(h.down_bps) for h in topo.hosts}
    rack_of = {h.name: str(h.rack) for h in topo.hosts}
    rup = {str(u.rack): float(u.up_bps) for u in topo.uplinks}
    rdown = {str(u.rack): float(u.down_bps) for u in topo.uplinks}
    names = topo.names
    lat = 0.0
    if len(names) > 1:
        lat = max(topo.path_latency(a, b) for a in names for b in names if a != b and topo.alive(a, b))
    return cls(up, down, rack_of, rup, rdown, lat)


# --------------------------------------------------------------------------- pauses

class PausePlan(Protocol):
    def paused(self, t: float) -> frozenset:
        """Hosts whose up link is paused at time ``t`` (piecewise constant, right-continuous)."""

    def next_change(self, t: float) -> float:
        """The first time > ``t`` at which :meth:`paused` may change (``inf`` if never)."""


class NoPauses:
    def paused(self, t):
        return frozenset()

    def next_change(self, t):
        return math.inf


class StaticPauses:
    """Explicit ``(start_s, end_s, host)`` intervals (``end_s`` may be ``inf``)."""

    def __init__(self, intervals: Iterable[tuple[float, float, str]]):
        self.intervals = [(float(a), float(b), h) for a, b, h in intervals]
        for a, b, h in self.intervals:
            if not b > a:
                raise ValueError(f"pause interval for {h!r} must have end > start, got {a}..{b}")

    def paused(self, t):
        return frozenset(h for a, b, h in self.intervals if a <= t < b)

    def next_change(self, t):
        times = [x for a, b, _ in self.intervals for x in (a, b) if x > t * (1 + REL_EPS) + 1e-15]
        return min(times, default=math.inf)


class RotatingPauses:
    """``k`` hosts paused at a time, redrawn uniformly every ``period_s`` from ``start_s`` on (RAT §4.1).

    Draws are made lazily per epoch from the seeded ``rng`` in epoch order, so
    a run is reproducible from the seed."""

    def __init__(self, hosts: Sequence[str], k: int, period_s: float, rng: random.Random, start_s: float = 0.0,
                 rate_bps: float = 0.0):
        self.rate_bps = float(rate_bps)  # bit/s a paused host still sends (0: stopped)
        if not 0 <= k <= len(hosts):
            raise ValueError(f"k={k} paused hosts out of range for {len(hosts)} hosts")
        if period_s <= 0:
            raise ValueError("period_s must be > 0")
        self.hosts, self.k, self.period_s, self.start_s = list(hosts), k, float(period_s), float(start_s)
        self._rng = rng
        self._epochs: list[frozenset] = []

    def _epoch(self, t: float) -> int:
        return int(math.floor((t - self.start_s) / self.period_s + REL_EPS))

    def paused(self, t):
        if t < self.start_s or self.k == 0:
            return frozenset()
        e = self._epoch(t)
        while len(self._epochs) <= e:
            self._epochs.append(frozenset(self._rng.sample(self.hosts, self.k)))
        return self._epochs[e]

    def next_change(self, t):
        if self.k == 0:
            return math.inf
        if t < self.start_s:
            return self.start_s
        return self.start_s + (self._epoch(t) + 1) * self.period_s


# --------------------------------------------------------------------------- allocation

def allocate(caps: np.ndarray, flow_links: np.ndarray, parent: np.ndarray | None = None) -> np.ndarray:
    """Max-min fair rates by progressive filling.

    ``caps``: link capacities (L,).  ``flow_links``: (F, K) link indices per
    flow, padded with -1; a flow with no link at all gets rate ``inf``.
    ``parent``: (F,) index of the flow this one is capped by (a caught-up
    stream), or -1.  A capped flow freezes when its parent does (same level,
    so at the parent's rate).  Returns the rates (F,).
    """
    F = flow_links.shape[0]
    rates = np.zeros(F)
    if F == 0:
        return rates
    caps = np.asarray(caps, dtype=float)
    remaining = caps.copy()
    valid = flow_links >= 0
    has_link = valid.any(axis=1)
    rates[~has_link] = np.inf
    frozen = ~has_link
    children: dict[int, list[int]] = {}
    if parent is not None:
        for i, p in enumerate(parent):
            if p >= 0:
                children.setdefault(int(p), []).append(i)
    L = caps.shape[0]
    while not frozen.all():
        live = ~frozen
        idx = flow_links[live]
        counts = np.bincount(idx[idx >= 0], minlength=L).astype(float)
        used = counts > 0
        share = np.full(L, np.inf)
        share[used] = np.maximum(remaining[used], 0.0) / counts[used]
        d = share.min()
        if not math.isfinite(d):  # only unlimited links left (cannot happen with host links)
            rates[live] = np.inf
            break
        rates[live] += d
        remaining[used] -= counts[used] * d
        sat = used & (remaining <= REL_EPS * np.maximum(caps, 1e-300))
        hit = (np.isin(flow_links, np.flatnonzero(sat)) & valid).any(axis=1) & live
        newly = list(np.flatnonzero(hit))
        frozen |= hit
        # a caught-up stream freezes with its parent (transitively)
        stack = newly
        while stack and children:
            j = stack.pop()
            for c in children.get(int(j), ()):
                if not frozen[c]:
                    frozen[c] = True
                    stack.append(c)
    return rates


# --------------------------------------------------------------------------- simulation

@dataclasses.dataclass
class FluidResult:
    """Outcome of :func:`simulate` (times in seconds from 0)."""

    completion_s: float
    start_s: dict
    finish_s: dict  # last byte + latency
    peak_link_util: float  # max over links and epochs of load/capacity (<= 1 by invariant 1)
    events: int


def _check_dag(flows: Mapping[Hashable, Flow]):
    for f in flows.values():
        for d in _deps(f):
            if d not in flows:
                raise DeadlockError(f"flow {f.name!r} depends on unknown flow {d!r}")
        if f.stream_from is not None:
            up = flows[f.stream_from]
            if abs(up.nbytes - f.nbytes) > 1e-9 * max(1.0, up.nbytes):
                raise ValueError(f"flow {f.name!r} streams from {up.name!r} of a different size "
                                 f"({f.nbytes} vs {up.nbytes}); split it into equal-size flows")
    state: dict = {}
    for root in flows:
        if root in state:
            continue
        stack = [(root, iter(_deps(flows[root])))]
        state[root] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                raise DeadlockError(f"dependency cycle through flow {nxt!r}")
            elif nxt not in state:
                state[nxt] = 1
                stack.append((nxt, iter(_deps(flows[nxt]))))


def _deps(f: Flow):
    return f.after + f.after_sent + ((f.stream_from,) if f.stream_from is not None else ())


def simulate(network: FluidNetwork, flows: Iterable[Flow], *, pauses: PausePlan | None = None,
             max_events: int = 10_000_000) -> FluidResult:
    """Run the flows to completion; return the completion time and per-flow start/finish times."""
    pauses = pauses or NoPauses()
    by_name: dict = {}
    for f in flows:
        if f.name in by_name:
            raise ValueError(f"duplicate flow name {f.name!r}")
        by_name[f.name] = f
    _check_dag(by_name)
    lat = float(network.latency_s)

    link_index: dict = {}
    path: dict = {}
    for f in by_name.values():
        ids = []
        for link in network.links_of(f.src, f.dst):
            ids.append(link_index.setdefault(link, len(link_index)))
        path[f.name] = ids
    links = list(link_index)
    K = max((len(p) for p in path.values()), default=1) or 1

    waiting_on = {n: len(set(f.after)) + len(set(f.after_sent)) for n, f in by_name.items()}
    dependents: dict = {}
    sent_dependents: dict = {}
    for n, f in by_name.items():
        for d in set(f.after):
            dependents.setdefault(d, []).append(n)
        for d in set(f.after_sent):
            sent_dependents.setdefault(d, []).append(n)

    def last_byte_left(n, t):
        for c in sent_dependents.get(n, ()):
            waiting_on[c] -= 1
            maybe_schedule(c, t)
    stream_children: dict = {}
    for n, f in by_name.items():
        if f.stream_from is not None:
            stream_children.setdefault(f.stream_from, []).append(n)

    start_s: dict = {}
    finish_s: dict = {}
    sent: dict = {}  # bytes sent so far, for started flows
    active: list = []  # started, not all bytes sent
    pending_start: list = []  # (time, name) heap-free list; small
    pending_finish: list = []  # (time, name): last byte sent, awaiting latency

    def maybe_schedule(n, t):
        f = by_name[n]
        if waiting_on[n] > 0:
            return
        if f.stream_from is not None and f.stream_from not in start_s:
            return
        t0 = max(t, f.not_before_s)
        if f.stream_from is not None:
            t0 = max(t0, start_s[f.stream_from] + lat)
        pending_start.append((t0 + f.delay_s, n))

    t = 0.0
    for n in by_name:
        maybe_schedule(n, 0.0)

    peak = 0.0
    events = 0
    paused = pauses.paused(0.0)
    while len(finish_s) < len(by_name):
        events += 1
        if events > max_events:
            raise DeadlockError(f"more than {max_events} events; raise max_events for a longer run")
        # 1. start flows whose time has come
        due = [(ts, n) for ts, n in pending_start if ts <= t * (1 + REL_EPS) + 1e-15]
        if due:
            pending_start[:] = [(ts, n) for ts, n in pending_start if ts > t * (1 + REL_EPS) + 1e-15]
            for _, n in due:
                start_s[n] = t
                sent[n] = 0.0
                if by_name[n].nbytes <= ABS_BYTES_EPS or not path[n]:
                    sent[n] = by_name[n].nbytes
                    pending_finish.append((t + (lat if path[n] else 0.0), n))
                    last_byte_left(n, t)
                else:
                    active.append(n)
                for c in stream_children.get(n, ()):
                    maybe_schedule(c, t)
        # 2. finish flows whose latency elapsed
        done = [(tf, n) for tf, n in pending_finish if tf <= t * (1 + REL_EPS) + 1e-15]
        if done:
            pending_finish[:] = [(tf, n) for tf, n in pending_finish if tf > t * (1 + REL_EPS) + 1e-15]
            for _, n in done:
                finish_s[n] = t
                for c in dependents.get(n, ()):
                    waiting_on[c] -= 1
                    maybe_schedule(c, t)
            if due or done:
                continue  # zero-length flows may cascade at the same instant
        if due:
            continue
        if len(finish_s) == len(by_name):
            break
        # 3. allocate
        paused = pauses.paused(t)
        pbps = float(getattr(pauses, "rate_bps", 0.0))
        caps = np.array([network.capacity_Bps(l, paused, pbps) for l in links]) if links else np.zeros(0)
        F = len(active)
        fl = np.full((F, K), -1, dtype=np.int64)
        pos = {n: i for i, n in enumerate(active)}
        parent = np.full(F, -1, dtype=np.int64)
        for i, n in enumerate(active):
            p = path[n]
            fl[i, :len(p)] = p
            up = by_name[n].stream_from
            if up is not None and up in pos and sent[n] >= sent[up] - ABS_BYTES_EPS:
                parent[i] = pos[up]
        rates = allocate(caps, fl, parent)
        if F and len(links):
            ok = fl >= 0
            load = np.bincount(fl[ok], weights=np.broadcast_to(rates[:, None], fl.shape)[ok], minlength=len(links))
            with np.errstate(divide="ignore", invalid="ignore"):
                util = np.where(caps > 0, load / np.where(caps > 0, caps, 1), np.where(load > 1e-12, np.inf, 0))
            peak = max(peak, float(util.max()))
        # 4. next event
        t_next = pauses.next_change(t)
        t_next = min([t_next] + [ts for ts, _ in pending_start] + [tf for tf, _ in pending_finish])
        rem = np.array([by_name[n].nbytes - sent[n] for n in active]) if F else np.zeros(0)
        with np.errstate(divide="ignore"):
            t_done = np.where(rates > 0, rem / np.where(rates > 0, rates, 1), np.inf)
        if F:
            t_next = min(t_next, t + float(t_done.min()))
            for i, n in enumerate(active):  # a stream catching up with its upstream
                up = by_name[n].stream_from
                if up is None or up not in pos or parent[i] >= 0:
                    continue
                j = pos[up]
                gap = sent[up] - sent[n]
                if rates[i] > rates[j] and gap > 0:
                    t_next = min(t_next, t + gap / (rates[i] - rates[j]))
        if not math.isfinite(t_next):
            stuck = [n for n in by_name if n not in finish_s][:5]
            raise DeadlockError(f"no flow can progress (paused forever or unmet dependency): {stuck}")
        dt = max(t_next - t, 0.0)
        # 5. advance
        new = {n: min(by_name[n].nbytes, sent[n] + rates[i] * dt) for i, n in enumerate(active)}
        still, sent_now = [], []
        for n in active:
            up = by_name[n].stream_from
            if up is not None and up in new:
                new[n] = min(new[n], new[up])  # float drift only: a caught stream runs at its upstream's rate
            sent[n] = new[n]
            if by_name[n].nbytes - sent[n] <= ABS_BYTES_EPS + REL_EPS * by_name[n].nbytes:
                sent[n] = by_name[n].nbytes
                pending_finish.append((t_next + lat, n))
                sent_now.append(n)
            else:
                still.append(n)
        active = still
        t = t_next
        for n in sent_now:
            last_byte_left(n, t)
    return FluidResult(max(finish_s.values(), default=0.0), start_s, finish_s, peak, events)


# --------------------------------------------------------------------------- baseline flow DAGs

def ps_flows(workers: Sequence[str], nbytes: float, servers: Sequence[str] | None = None, *,
             prefix: str = "ps") -> list[Flow]:
    """Direct PS round: every worker pushes ``nbytes/K`` to each of the ``K`` shards; each shard, once all
    pushes into it arrived, sends its ``nbytes/K`` of parameters back to every worker.  ``servers``
    defaults to the workers' own hosts (RAT §4.2: a PS shard colocated on every server)."""
    servers = list(workers) if servers is None else list(servers)
    K = len(servers)
    part = nbytes / K
    flows = []
    for j, s in enumerate(servers):
        pushes = [(prefix, "push", w, j) for w in range(len(workers))]
        flows += [Flow(name, workers[w], s, part) for name, w in zip(pushes, range(len(workers)))]
        flows += [Flow((prefix, "pull", j, w), s, workers[w], part, after=pushes) for w in range(len(workers))]
    return flows


def ring_flows(hosts: Sequence[str], nbytes: float, *, prefix: str = "ring") -> list[Flow]:
    """Ring all-reduce in the given order: ``2(n-1)`` steps (reduce-scatter, all-gather), each node sending
    a chunk of ``nbytes/n`` to its successor per step.  Step ``s`` of node ``i`` waits for its own step
    ``s-1`` send and for the chunk its predecessor sent it in step ``s-1`` -- the dependency that makes one
    blocked hop throttle every downstream hop (RAT §2.2, "chain blocking")."""
    n = len(hosts)
    if n < 2:
        return []
    chunk = nbytes / n
    flows = []
    for s in range(2 * (n - 1)):
        for i in range(n):
            after = [] if s == 0 else [(prefix, s - 1, i), (prefix, s - 1, (i - 1) % n)]
            flows.append(Flow((prefix, s, i), hosts[i], hosts[(i + 1) % n], chunk, after=after))
    return flows
