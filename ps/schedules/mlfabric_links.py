"""MLfabric's view of the network: links, paths, and a time-varying reservation table.

Theory of operation
-------------------
MLfabric (paper §5.1.1, Fig 4) schedules transfers at *non-overlapping* times
on bottleneck links: each transfer is given, for every instant, the residual
bottleneck rate of its path, and that rate is *reserved* on every link of the
path until the transfer's bytes are done.  The state this needs is, per link,
the residual capacity as a function of future time.

:class:`ReservationTable` holds that function per link as a piecewise-constant
step list: breakpoints ``times[0] < times[1] < ...`` and ``rates[i]`` valid on
``[times[i], times[i+1])`` (the last one forever).  Two operations:

* :meth:`ReservationTable.finish_time` -- ``t_en`` of Fig 4(b): walk the merged
  breakpoints of the path's links from ``start`` and pour ``nbytes`` through
  ``min(residual)`` until they are all through;
* :meth:`ReservationTable.reserve` -- ``NetUp`` of Fig 4(c): the same walk, and
  subtract the rate used from every link of the path.

Invariants (property-tested): residual rates never go below zero and never
above the link's capacity; a reservation never makes the table's total
reserved rate on a link exceed its capacity; ``finish_time`` equals the end of
the reservation that ``reserve`` would make; ``restore(snapshot(...))`` undoes
reservations exactly.

Rates are bytes per second, times seconds on the controller's clock.  The
network model is the paper's: every host has an uplink and a downlink (its
NIC), hosts in one rack share the rack's uplink/downlink to the core, and the
core is non-blocking.  Transfers between two nodes of one host use no link
(they finish the instant they start).  Propagation latency is not modelled:
the paper's ``t_en`` is bandwidth-only, and at the sizes MLfabric schedules
(MBs) it is a rounding error.
"""

from __future__ import annotations

import dataclasses
import math
from bisect import bisect_right
from typing import Iterable, Mapping, Sequence

INF = math.inf

# A link id is a tuple ("up"|"down", host) or ("rack_up"|"rack_down", rack).
LINK_UP = "up"
LINK_DOWN = "down"
LINK_RACK_UP = "rack_up"
LINK_RACK_DOWN = "rack_down"

# Float slack when comparing reserved rates with capacities (bytes/s, relative).
RATE_REL_TOLERANCE = 1e-9


@dataclasses.dataclass(frozen=True)
class FabricNetwork:
    """Link capacities the scheduler plans on (bytes/s), as last reported by the network monitor.

    ``up[h]``/``down[h]``: host ``h``'s NIC rates.  ``rack_of[h]`` (optional):
    its rack; hosts of different racks also cross ``rack_up[rack]`` of the
    sender's rack and ``rack_down[rack]`` of the receiver's (where the rack has
    an uplink rate; a rack without one reaches the spine unconstrained).  ``host_of[node]``
    (optional) maps a node id (``"worker:3"``) to its host; a node not in it is
    its own host.
    """

    up: Mapping
    down: Mapping
    rack_of: Mapping = dataclasses.field(default_factory=dict)
    rack_up: Mapping = dataclasses.field(default_factory=dict)
    rack_down: Mapping = dataclasses.field(default_factory=dict)
    host_of: Mapping = dataclasses.field(default_factory=dict)
    blocked: frozenset = frozenset()  # frozenset({host_a, host_b}) pairs that cannot talk (failed / blocked)

    def __post_init__(self):
        for name, table in (("up", self.up), ("down", self.down), ("rack_up", self.rack_up),
                            ("rack_down", self.rack_down)):
            for k, v in table.items():
                if not (v >= 0) or v == INF:
                    raise ValueError(f"FabricNetwork.{name}[{k!r}] = {v!r}: rates must be finite and >= 0 bytes/s")
        for rack in set(self.rack_up) ^ set(self.rack_down):
            raise ValueError(f"rack {rack!r} has only one of rack_up/rack_down; give both rates of its uplink")

    def host(self, node) -> object:
        return self.host_of.get(node, node)

    def reachable(self, src, dst) -> bool:
        """False if the pair of hosts is blocked (a failed link or a ``Lab.block``)."""
        return frozenset((self.host(src), self.host(dst))) not in self.blocked

    def path(self, src, dst) -> tuple:
        """Link ids a transfer from node ``src`` to node ``dst`` crosses (empty within one host).

        Check :meth:`reachable` first: a blocked pair still has a path here.
        """
        hs, hd = self.host(src), self.host(dst)
        if hs == hd:
            return ()
        for h in (hs, hd):
            if h not in self.up or h not in self.down:
                raise ValueError(f"host {h!r} has no up/down rate in the FabricNetwork; add it to up= and down=")
        links = [(LINK_UP, hs)]
        rs, rd = self.rack_of.get(hs), self.rack_of.get(hd)
        if rs != rd:  # racks without an uplink rate: the spine is not a bottleneck for them
            if rs in self.rack_up:
                links.append((LINK_RACK_UP, rs))
            if rd in self.rack_down:
                links.append((LINK_RACK_DOWN, rd))
        links.append((LINK_DOWN, hd))
        return tuple(links)

    @classmethod
    def from_topology(cls, topology, *, host_of: Mapping | None = None) -> "FabricNetwork":
        """From a :class:`~ltp_ps.schedules.topology.Topology` (rates in bit/s there, bytes/s here).

        Use ``World.effective_topology()`` so hosts are named by node id, or pass
        ``host_of`` (node -> topology host name).
        """
        up = {h.name: h.up_bps / 8.0 for h in topology.hosts}
        down = {h.name: h.down_bps / 8.0 for h in topology.hosts}
        rack_of, rack_up, rack_down = {}, {}, {}
        for u in topology.uplinks:
            rack_up[u.rack], rack_down[u.rack] = u.up_bps / 8.0, u.down_bps / 8.0
        for h in topology.hosts:
            rack_of[h.name] = h.rack
        blocked = frozenset(frozenset(p) for p in topology.failed)
        return cls(up, down, rack_of, rack_up, rack_down, dict(host_of or {}), blocked)

    def with_rates(self, up: Mapping | None = None, down: Mapping | None = None) -> "FabricNetwork":
        """The network with some host rates replaced (the monitor's refresh every ``t_lag``)."""
        return dataclasses.replace(self, up={**self.up, **(up or {})}, down={**self.down, **(down or {})})

    def capacities(self) -> dict:
        """``{link id: capacity}`` of every link."""
        caps = {(LINK_UP, h): float(r) for h, r in self.up.items()}
        caps.update({(LINK_DOWN, h): float(r) for h, r in self.down.items()})
        caps.update({(LINK_RACK_UP, k): float(r) for k, r in self.rack_up.items()})
        caps.update({(LINK_RACK_DOWN, k): float(r) for k, r in self.rack_down.items()})
        return caps


@dataclasses.dataclass(frozen=True)
class Reservation:
    """Rate reserved on ``links``: ``rates[i]`` bytes/s on ``[times[i], times[i+1])``; ends at ``times[-1]``."""

    links: tuple
    times: tuple  # len(rates) + 1 breakpoints
    rates: tuple
    nbytes: float

    @property
    def start(self) -> float:
        return self.times[0]

    @property
    def end(self) -> float:
        return self.times[-1]


def _steps(segs: Sequence) -> tuple:
    """``(times, rates)`` of consecutive ``(t0, t1, rate)`` segments, zero-rate steps filling any gaps."""
    times, rates = [segs[0][0]], []
    for t0, t1, r in segs:
        if t0 > times[-1]:
            rates.append(0.0)
            times.append(t0)
        rates.append(r)
        times.append(t1)
    return tuple(times), tuple(rates)


class ReservationTable:
    """Residual capacity per link over future time (piecewise constant), with reservations.

    Build it from link capacities at ``now``; every link starts with its full
    capacity from ``now`` on.  Times before ``now`` are never looked at.
    """

    __slots__ = ("now", "capacity", "_t", "_r", "reservations")

    def __init__(self, capacities: Mapping, *, now: float):
        self.now = float(now)
        self.capacity = {l: float(c) for l, c in capacities.items()}
        for l, c in self.capacity.items():
            if not (c >= 0) or c == INF:
                raise ValueError(f"capacity of link {l!r} is {c!r}; use a finite rate >= 0 bytes/s")
        self._t = {l: [self.now] for l in self.capacity}
        self._r = {l: [c] for l, c in self.capacity.items()}
        self.reservations: list = []  # every Reservation made on this table (kept for re-rating and audits)

    @classmethod
    def for_network(cls, net: FabricNetwork, *, now: float) -> "ReservationTable":
        return cls(net.capacities(), now=now)

    # -- copies and undo ------------------------------------------------------------------------------------------
    def copy(self) -> "ReservationTable":
        new = ReservationTable.__new__(ReservationTable)
        new.now = self.now
        new.capacity = self.capacity
        # step lists are shared, never mutated in place: _shift copies a link's lists before changing them
        new._t = dict(self._t)
        new._r = dict(self._r)
        new.reservations = list(self.reservations)
        return new

    def snapshot(self, links: Iterable) -> tuple:
        """State of ``links`` (for :meth:`restore`): cheap undo of reservations on those links only."""
        return ({l: (list(self._t[l]), list(self._r[l])) for l in links}, len(self.reservations))

    def restore(self, snap: tuple) -> None:
        state, n_res = snap
        for l, (t, r) in state.items():
            self._t[l], self._r[l] = list(t), list(r)
        del self.reservations[n_res:]

    def add_links(self, capacities: Mapping) -> None:
        """Add links this table does not know yet (a host that joined), at full capacity from ``now``."""
        for l, c in capacities.items():
            if l not in self.capacity:
                c = float(c)
                if not (c >= 0) or c == INF:
                    raise ValueError(f"capacity of link {l!r} is {c!r}; use a finite rate >= 0 bytes/s")
                self.capacity = {**self.capacity, l: c}
                self._t[l] = [self.now]
                self._r[l] = [c]

    # -- queries --------------------------------------------------------------------------------------------------
    def links(self) -> list:
        return list(self.capacity)

    def residual(self, link, t: float) -> float:
        """Residual rate of ``link`` at time ``t`` (bytes/s)."""
        times = self._t[link]
        i = bisect_right(times, t) - 1
        return self._r[link][max(i, 0)]

    def profile(self, link) -> tuple:
        """``(times, rates)`` of ``link``'s residual step function (copies)."""
        return tuple(self._t[link]), tuple(self._r[link])

    def _walk(self, links: Sequence, nbytes: float, start: float, record: list | None) -> float:
        """Pour ``nbytes`` through ``links`` from ``start``; return the finish time (INF if never).

        With ``record`` (a list), append ``(t0, t1, rate)`` for every segment used.
        """
        start = max(float(start), self.now)
        if nbytes <= 0 or not links:
            return start
        ts = [self._t[l] for l in links]
        rs = [self._r[l] for l in links]
        idx = [bisect_right(t, start) - 1 for t in ts]
        t = start
        remaining = float(nbytes)
        n = len(links)
        while True:
            rate = INF
            nxt = INF
            for j in range(n):
                i = idx[j]
                r = rs[j][i]
                if r < rate:
                    rate = r
                tj = ts[j]
                if i + 1 < len(tj) and tj[i + 1] < nxt:
                    nxt = tj[i + 1]
            if rate > 0:
                if nxt == INF or rate * (nxt - t) >= remaining:
                    end = t + remaining / rate
                    if record is not None and end > t:
                        record.append((t, end, rate))
                    return end
                remaining -= rate * (nxt - t)
                if record is not None:
                    record.append((t, nxt, rate))
            elif nxt == INF:
                return INF
            t = nxt
            for j in range(n):
                tj = ts[j]
                i = idx[j]
                if i + 1 < len(tj) and tj[i + 1] <= t:
                    idx[j] = i + 1

    def finish_time(self, links: Sequence, nbytes: float, start: float) -> float:
        """``t_en``: when ``nbytes`` sent over ``links`` from ``start`` at the residual bottleneck rate are through."""
        return self._walk(links, nbytes, start, None)

    # -- updates --------------------------------------------------------------------------------------------------
    def reserve(self, links: Sequence, nbytes: float, start: float) -> Reservation:
        """``NetUp``: reserve the residual bottleneck rate on ``links`` from ``start`` until ``nbytes`` are through.

        Raises ``ValueError`` if the path can never carry the bytes (a zero-rate
        link forever); check :meth:`finish_time` first.
        """
        links = tuple(links)
        segs: list = []
        end = self._walk(links, nbytes, start, segs)
        if end == INF:
            raise ValueError(f"cannot reserve {nbytes} bytes on {links}: the path has no capacity left; "
                             "check finish_time() for INF first")
        for l in links:
            self._subtract(l, segs)
        if segs:
            times, rates = _steps(segs)
            if end > times[-1]:  # the last bytes were below float resolution at that time scale
                times, rates = times + (end,), rates + (0.0,)
        else:  # nothing to carry (or a sliver below float resolution): a zero-length reservation at the end
            times, rates = (end, end), (0.0,)
        res = Reservation(links, times, rates, float(nbytes))
        self.reservations.append(res)
        return res

    def _split(self, link, t: float) -> int:
        """Make ``t`` a breakpoint of ``link``; return its index."""
        times, rates = self._t[link], self._r[link]
        i = bisect_right(times, t) - 1
        if times[i] == t:
            return i
        times.insert(i + 1, t)
        rates.insert(i + 1, rates[i])
        return i + 1

    def _subtract(self, link, segs: Sequence) -> None:
        self._shift(link, segs, 1.0)

    def _shift(self, link, segs: Sequence, sign: float) -> None:
        """Subtract (``sign=1``) or give back (``sign=-1``) ``(t0, t1, rate)`` segments on ``link``.

        Residuals are clamped to ``[0, capacity]``.
        """
        if not segs:
            return
        self._t[link] = list(self._t[link])  # copy on write: copies of this table may share the old lists
        rates = self._r[link] = list(self._r[link])
        cap = self.capacity[link]
        for t0, t1, r in segs:
            if t1 <= t0:
                continue
            i = self._split(link, t0)
            j = self._split(link, t1)
            for x in range(i, j):
                v = rates[x] - sign * r
                rates[x] = cap if v > cap else (v if v > 0 else 0.0)
        self._coalesce(link)

    def release(self, res: Reservation) -> None:
        """Give a reservation's rates back (a transfer cancelled or moved); it leaves the log."""
        for i, r in enumerate(self.reservations):
            if r is res:
                del self.reservations[i]
                break
        else:
            raise ValueError("release() of a reservation this table does not hold; release it on the table "
                             "(or a copy of the table) that made it")
        segs = [(max(t0, self.now), t1, r) for t0, t1, r in zip(res.times[:-1], res.times[1:], res.rates)
                if t1 > self.now and r > 0]
        for l in res.links:
            if l in self.capacity:
                self._shift(l, segs, -1.0)

    def _coalesce(self, link) -> None:
        times, rates = self._t[link], self._r[link]
        if len(times) < 2:
            return
        nt, nr = [times[0]], [rates[0]]
        for t, r in zip(times[1:], rates[1:]):
            if r == nr[-1]:
                continue
            nt.append(t)
            nr.append(r)
        self._t[link], self._r[link] = nt, nr

    def advance(self, now: float) -> None:
        """Forget the past: drop breakpoints before ``now`` (reservations that ended stay in the log)."""
        now = float(now)
        if now <= self.now:
            return
        for l in self.capacity:
            times, rates = self._t[l], self._r[l]
            i = bisect_right(times, now) - 1
            self._t[l] = [now] + times[i + 1:]
            self._r[l] = rates[i:]
        self.now = now
        self.reservations = [r for r in self.reservations if r.end > now]

    def rerate(self, capacities: Mapping, *, now: float) -> "ReservationTable":
        """A new table at ``now`` with fresh link capacities (the monitor's report every ``t_lag``).

        Reservations still running at ``now`` are carried over in the order they
        were made, each clamped to what its path has left under the new
        capacities (a transfer whose link slowed down keeps only what fits: it
        will run late, and the next plan sees that link as busy).
        """
        new = ReservationTable(capacities, now=now)
        for res in self.reservations:
            if res.end <= now:
                continue
            links = tuple(l for l in res.links if l in new.capacity)
            segs = []
            for t0, t1, r in zip(res.times[:-1], res.times[1:], res.rates):
                if t1 <= now or r <= 0:
                    continue
                for a, b, m in new._path_steps(links, max(t0, now), t1):
                    if min(r, m) > 0:
                        segs.append((a, b, min(r, m)))
            for l in links:
                new._subtract(l, segs)
            if segs:
                times, rates = _steps(segs)
                new.reservations.append(Reservation(links, times, rates, res.nbytes))
        return new

    def _path_steps(self, links: Sequence, t0: float, t1: float):
        """``(a, b, min residual)`` over ``[t0, t1)`` split at every breakpoint of ``links``."""
        if not links:
            return
        points = {t0, t1}
        for l in links:
            points.update(t for t in self._t[l] if t0 < t < t1)
        pts = sorted(points)
        for a, b in zip(pts, pts[1:]):
            yield a, b, min(self.residual(l, a) for l in links)

    def reserved_rate(self, link, t: float) -> float:
        """Sum of the rates reservations hold on ``link`` at ``t`` (audit helper for tests)."""
        total = 0.0
        for res in self.reservations:
            if link not in res.links or not (res.times[0] <= t < res.times[-1]):
                continue
            i = bisect_right(res.times, t) - 1
            total += res.rates[i]
        return total

    def check(self) -> None:
        """Assert the invariants: 0 <= residual <= capacity, reservations within capacity at every breakpoint."""
        for l, cap in self.capacity.items():
            slack = RATE_REL_TOLERANCE * max(cap, 1.0)
            for t, r in zip(self._t[l], self._r[l]):
                if r < 0 or r > cap + slack:
                    raise AssertionError(f"link {l!r} residual {r} outside [0, {cap}] at t={t}")
            points = set(self._t[l])
            for res in self.reservations:
                if l in res.links:
                    points.update(res.times[:-1])
            for t in points:
                if t < self.now:
                    continue
                used = self.reserved_rate(l, t)
                if used > cap + slack:
                    raise AssertionError(f"link {l!r} over-reserved at t={t}: {used} > capacity {cap}")
