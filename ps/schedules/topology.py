"""The network a schedule plans for: hosts, racks, rates, latencies, failed pairs.

Theory of operation
-------------------
A :class:`Topology` is plain, immutable data.  Model: every host hangs off its
rack's switch by a link with its own upload and download rate (bit/s) and
one-way latency (seconds); racks join a spine through uplinks with their own
rates and delay.  A transfer ``a -> b`` inside one rack crosses ``a``'s
upload and ``b``'s download; across racks it also crosses ``a``'s rack uplink
(up) and ``b``'s rack uplink (down).  :meth:`path_rate` is the bottleneck of
those links, :meth:`path_latency` the sum of the one-way delays.  Pairs in
``failed`` cannot talk (a blocked pair, a dead link); ``measured`` holds
per-pair estimates (RTprop, BtlBw) that override the model when known.

Sources: :meth:`from_json` (file or dict, schema in ``docs/schedules.md``),
:meth:`from_lab` (a ``ltp_tools.netlab.Lab`` and its impairments),
:meth:`from_measurements` (per-peer RTprop/BtlBw from transport reports), and
:meth:`uniform` (tests, ``ltp-ps plan`` without a file).

Host names are free-form; a schedule maps node ids (``"worker:3"``) to hosts
through its world's placement (``ltp_ps.schedules.base.World``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Iterable, Mapping, Sequence

DEFAULT_RATE_BPS = 10e9  # bit/s when a file names no rate
DEFAULT_LATENCY_S = 25e-6  # seconds one-way host <-> switch when nothing is known


@dataclasses.dataclass(frozen=True)
class HostLink:
    """One host's link to its rack switch."""

    name: str
    rack: int = 0
    up_bps: float = DEFAULT_RATE_BPS  # bit/s, host -> switch
    down_bps: float = DEFAULT_RATE_BPS  # bit/s, switch -> host
    latency_s: float = DEFAULT_LATENCY_S  # seconds one-way

    def __post_init__(self):
        if self.up_bps <= 0 or self.down_bps <= 0 or self.latency_s < 0:
            raise ValueError(f"host {self.name!r}: rates must be > 0 and latency >= 0")


@dataclasses.dataclass(frozen=True)
class Uplink:
    """A rack's link to the spine."""

    rack: int
    up_bps: float = DEFAULT_RATE_BPS  # bit/s, rack -> spine
    down_bps: float = DEFAULT_RATE_BPS  # bit/s, spine -> rack
    delay_s: float = 0.0  # seconds one-way

    def __post_init__(self):
        if self.up_bps <= 0 or self.down_bps <= 0 or self.delay_s < 0:
            raise ValueError(f"uplink of rack {self.rack}: rates must be > 0 and delay >= 0")


def _pair(a: str, b: str) -> frozenset:
    return frozenset((a, b))


@dataclasses.dataclass(frozen=True)
class Topology:
    hosts: tuple = ()  # tuple[HostLink, ...]
    uplinks: tuple = ()  # tuple[Uplink, ...] (racks without one: the spine is not a bottleneck)
    failed: frozenset = frozenset()  # frozenset of frozenset({a, b})
    measured: Mapping = dataclasses.field(default_factory=dict)  # (a, b) -> (rtprop_s, btlbw_bps)

    def __post_init__(self):
        names = [h.name for h in self.hosts]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate host names in topology: {names}")
        object.__setattr__(self, "_by_name", {h.name: h for h in self.hosts})
        object.__setattr__(self, "_uplink", {u.rack: u for u in self.uplinks})

    # -- queries ----------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hosts]

    def host(self, name: str) -> HostLink:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"host {name!r} is not in the topology (hosts: {self.names[:8]}...)") from None

    def rack_of(self, name: str) -> int:
        return self.host(name).rack

    def racks(self) -> dict[int, list[str]]:
        out: dict = {}
        for h in self.hosts:
            out.setdefault(h.rack, []).append(h.name)
        return out

    def uplink(self, rack: int) -> Uplink | None:
        return self._uplink.get(rack)

    def alive(self, a: str, b: str) -> bool:
        """False if the pair is blocked/failed."""
        return _pair(a, b) not in self.failed

    def path_links(self, a: str, b: str) -> list[tuple]:
        """Directed links ``a -> b`` crosses: ``("up", host)``, ``("uplink_up", rack)``, ... (for fair sharing)."""
        ha, hb = self.host(a), self.host(b)
        links = [("up", a)]
        if ha.rack != hb.rack:
            if self.uplink(ha.rack) is not None:
                links.append(("uplink_up", ha.rack))
            if self.uplink(hb.rack) is not None:
                links.append(("uplink_down", hb.rack))
        links.append(("down", b))
        return links

    def link_rate(self, link: tuple) -> float:
        kind, key = link
        if kind == "up":
            return self.host(key).up_bps
        if kind == "down":
            return self.host(key).down_bps
        u = self.uplink(key)
        return u.up_bps if kind == "uplink_up" else u.down_bps

    def path_rate(self, a: str, b: str) -> float:
        """Bottleneck rate of ``a -> b`` in bit/s (measured BtlBw if known); 0 for a failed pair."""
        if not self.alive(a, b):
            return 0.0
        m = self.measured.get((a, b))
        if m is not None and m[1] > 0:
            return float(m[1])
        return min(self.link_rate(link) for link in self.path_links(a, b))

    def path_latency(self, a: str, b: str) -> float:
        """One-way latency ``a -> b`` in seconds (half the measured RTprop if known); inf if failed."""
        if not self.alive(a, b):
            return math.inf
        m = self.measured.get((a, b))
        if m is not None and m[0] > 0:
            return float(m[0]) / 2
        ha, hb = self.host(a), self.host(b)
        lat = ha.latency_s + hb.latency_s
        if ha.rack != hb.rack:
            for r in (ha.rack, hb.rack):
                u = self.uplink(r)
                lat += u.delay_s if u is not None else 0.0
        return lat

    def transfer_time(self, a: str, b: str, nbytes: float) -> float:
        """alpha + beta * D for one transfer alone on the path (seconds)."""
        rate = self.path_rate(a, b)
        if rate <= 0:
            return math.inf
        return self.path_latency(a, b) + 8.0 * nbytes / rate

    # -- edits (new objects) -------------------------------------------------
    def with_failed(self, pairs: Iterable[tuple]) -> "Topology":
        return dataclasses.replace(self, failed=self.failed | {_pair(a, b) for a, b in pairs})

    def with_measured(self, measured: Mapping) -> "Topology":
        return dataclasses.replace(self, measured={**self.measured, **measured})

    def with_host_rates(self, rates: Mapping) -> "Topology":
        """``{name: (up_bps, down_bps)}`` replaced (MLfabric's refreshed link rates)."""
        hosts = tuple(dataclasses.replace(h, up_bps=rates[h.name][0], down_bps=rates[h.name][1])
                      if h.name in rates else h for h in self.hosts)
        return dataclasses.replace(self, hosts=hosts)

    def subset(self, names: Sequence[str]) -> "Topology":
        keep = set(names)
        return dataclasses.replace(self, hosts=tuple(h for h in self.hosts if h.name in keep))

    # -- constructors --------------------------------------------------------
    @classmethod
    def uniform(cls, names: Sequence[str], *, rate_bps: float = DEFAULT_RATE_BPS,
                latency_s: float = DEFAULT_LATENCY_S, racks: Sequence[int] | None = None,
                uplink_bps: float | None = None, uplink_delay_s: float = 0.0) -> "Topology":
        """Every host at ``rate_bps``; ``racks=[3, 3]`` puts consecutive hosts in racks with uplinks."""
        names = list(names)
        rack_of = [0] * len(names)
        uplinks = ()
        if racks:
            if sum(racks) != len(names):
                raise ValueError(f"racks {list(racks)} hold {sum(racks)} hosts, the topology has {len(names)}")
            rack_of = [r for r, k in enumerate(racks) for _ in range(k)]
            ub = uplink_bps if uplink_bps is not None else rate_bps
            uplinks = tuple(Uplink(r, ub, ub, uplink_delay_s) for r in range(len(racks)))
        hosts = tuple(HostLink(n, rk, rate_bps, rate_bps, latency_s) for n, rk in zip(names, rack_of))
        return cls(hosts, uplinks)

    @classmethod
    def from_json(cls, src) -> "Topology":
        """From a dict or a JSON file path (see ``docs/schedules.md`` for the schema)."""
        if isinstance(src, (str, os.PathLike)):
            try:
                with open(src) as f:
                    src = json.load(f)
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"cannot read topology file {src}: {exc}") from None
        if not isinstance(src, Mapping) or "hosts" not in src:
            raise ValueError("a topology needs a 'hosts' list (see docs/schedules.md)")
        d_rate = float(src.get("rate_bps", DEFAULT_RATE_BPS))
        d_lat = float(src.get("latency_s", DEFAULT_LATENCY_S))
        hosts = []
        for i, h in enumerate(src["hosts"]):
            if isinstance(h, str):
                h = {"name": h}
            rate = float(h.get("rate_bps", d_rate))
            hosts.append(HostLink(str(h.get("name", f"h{i}")), int(h.get("rack", 0)), float(h.get("up_bps", rate)),
                                  float(h.get("down_bps", rate)), float(h.get("latency_s", d_lat))))
        uplinks = []
        for u in src.get("uplinks", []):
            rate = float(u.get("rate_bps", d_rate))
            uplinks.append(Uplink(int(u["rack"]), float(u.get("up_bps", rate)), float(u.get("down_bps", rate)),
                                  float(u.get("delay_s", 0.0))))
        failed = frozenset(_pair(str(a), str(b)) for a, b in src.get("failed", []))
        measured = {(str(m["src"]), str(m["dst"])): (float(m.get("rtprop_s", 0.0)), float(m.get("btlbw_bps", 0.0)))
                    for m in src.get("measured", [])}
        return cls(tuple(hosts), tuple(uplinks), failed, measured)

    def to_json(self) -> dict:
        return {"hosts": [dataclasses.asdict(h) for h in self.hosts],
                "uplinks": [dataclasses.asdict(u) for u in self.uplinks],
                "failed": [sorted(p) for p in sorted(self.failed, key=sorted)],
                "measured": [{"src": a, "dst": b, "rtprop_s": r, "btlbw_bps": bw}
                             for (a, b), (r, bw) in sorted(self.measured.items())]}

    @classmethod
    def from_lab(cls, lab, *, default_rate_bps: float = DEFAULT_RATE_BPS) -> "Topology":
        """The lab's hosts (named ``h0``, ``h1``, ...), racks, rate limits, delays and uplinks."""
        hosts = []
        for h in lab.hosts:
            ing, eg = lab.impairment(h, "ingress"), lab.impairment(h, "egress")
            hosts.append(HostLink(h.name, h.rack, eg.rate_bps or default_rate_bps, ing.rate_bps or default_rate_bps,
                                  (ing.delay_s or 0.0) + (eg.delay_s or 0.0) + DEFAULT_LATENCY_S))
        uplinks = []
        for spec in getattr(lab, "uplink_specs", lambda: [])():
            uplinks.append(Uplink(spec["rack"], spec.get("rate_bps") or default_rate_bps,
                                  spec.get("rate_bps") or default_rate_bps, spec.get("delay_s") or 0.0))
        failed = frozenset(_pair(a, b) for a, b in getattr(lab, "blocked_pairs", lambda: [])())
        return cls(tuple(hosts), tuple(uplinks), failed)

    @classmethod
    def from_measurements(cls, me: str, peers: Mapping, *, base: "Topology | None" = None) -> "Topology":
        """Per-peer ``{name: (rtprop_s, btlbw_bps)}`` as seen from ``me`` (LTP's path estimates).

        Without a ``base``, hosts get a rate equal to the best estimate
        towards them and latency of half the RTprop.
        """
        measured = {(me, p): (float(r), float(bw)) for p, (r, bw) in peers.items()}
        if base is not None:
            return base.with_measured(measured)
        hosts = [HostLink(me)]
        for p, (r, bw) in peers.items():
            hosts.append(HostLink(p, 0, bw if bw > 0 else DEFAULT_RATE_BPS, bw if bw > 0 else DEFAULT_RATE_BPS,
                                  max(0.0, r / 2) if r > 0 else DEFAULT_LATENCY_S))
        return cls(tuple(hosts), (), frozenset(), measured)
