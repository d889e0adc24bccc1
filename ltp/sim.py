"""A deterministic in-memory network for driving :class:`~ltp.engine.Engine` objects.

Theory of operation. A discrete-event simulation with a virtual clock: each
engine is a host with an address; each directed link has a rate (bytes/s,
None = infinite), a propagation delay, optional jitter (which reorders), a
random loss probability, a duplication probability and a bounded queue (tail
drop). Every event (datagram arrival or engine timer) is processed at its
virtual time, after which the engine's output is routed through the links and
its next timer is scheduled. All randomness comes from one seeded
``random.Random``, so a run is exactly repeatable. Used by the unit tests and
handy for experimenting with protocol parameters without sockets.

A host can be *stalled* (:meth:`SimNetwork.stall`), as SIGSTOP would: until it
resumes, datagrams for it wait (as in a socket buffer) and its timer does not
run; on resume it reads what waited, then runs its timer.

A batch built in lanes (``SegmentTransmit.parts`` > 1, ``Config.spread_sends``)
goes out in order unless the network is told to play the adapter's sender
threads (``SimNetwork(interleave_parts=True)``): its parts then leave
interleaved, one datagram of each in turn, the last part first.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

__all__ = ["IP_UDP_HEADER_BYTES", "SimLink", "SimNetwork"]

#: bytes a link adds to each datagram when it times it (IPv4 20 + UDP 8): its rate is in IP packet bytes
IP_UDP_HEADER_BYTES = 28


@dataclass
class SimLink:
    """One direction of a link."""

    rate: float | None = None  # bytes/s
    delay_s: float = 0.0001
    jitter_s: float = 0.0
    loss: float = 0.0
    duplicate: float = 0.0
    queue_bytes: int | None = None
    #: drop only datagrams larger than this (lets ACKs through, like the lab's default rule)
    loss_min_size: int = 0
    #: deterministic loss: ``drop_if(data)`` true drops that datagram (counted as ``lost``), e.g. "the first REG"
    drop_if: object = None
    busy_until: float = 0.0
    stats: dict = field(default_factory=lambda: {"sent": 0, "lost": 0, "queue_drop": 0, "dup": 0})


class SimNetwork:
    """Hosts (engines) connected by :class:`SimLink` s, driven by a virtual clock."""

    def __init__(self, seed: int = 0, *, interleave_parts: bool = False) -> None:
        self.rng = random.Random(seed)
        #: send a batch's parts interleaved, as sender threads side by side may (see the module docstring)
        self.interleave_parts = interleave_parts
        self.now = 0.0
        self.hosts: dict = {}
        self.links: dict = {}
        self._heap: list = []
        self._seq = 0
        self._timer_version: dict = {}
        self.trace: list | None = None
        self._last_fire: dict = {}
        self._same_fire: dict = {}
        self._stalled: dict = {}  # addr -> virtual time it runs again

    def add_host(self, addr, engine) -> None:
        """Attach ``engine`` at address ``addr`` (a ``(host, port)`` tuple)."""
        self.hosts[addr] = engine
        if getattr(engine, "local_addr", addr) is None:
            engine.local_addr = addr  # REG MACs bind the source address
        self._timer_version[addr] = 0

    def set_link(self, src, dst, **params) -> SimLink:
        """Configure the link ``src → dst`` (see :class:`SimLink` for parameters)."""
        link = SimLink(**params)
        self.links[(src, dst)] = link
        return link

    def link(self, src, dst) -> SimLink:
        link = self.links.get((src, dst))
        if link is None:
            link = self.links[(src, dst)] = SimLink()
        return link

    def stall(self, addr, seconds: float) -> None:
        """Stop host ``addr`` from now for ``seconds`` (a SIGSTOPped process): its arrivals wait, its timer
        does not run; on resume it reads what arrived, then runs its (by then late) timer, then the flush its
        loop had scheduled before it stopped (commands issued to a stalled host, e.g. a ``send``, go out then)."""
        if addr not in self.hosts:
            raise KeyError(f"no host {addr!r}: add_host it first")
        self._stalled[addr] = self.now + seconds
        self._push(self.now + seconds + 2e-9, "resume", addr)

    def _stalled_until(self, addr) -> float | None:
        """When stalled host ``addr`` runs again; None when it runs now."""
        until = self._stalled.get(addr)
        return None if until is None or self.now >= until else until

    def _deferred(self, addr, kind: str, payload) -> bool:
        """Hold an event of a stalled host until it resumes (arrivals first); True if held."""
        until = self._stalled_until(addr)
        if until is None:
            return False
        self._push(until if kind == "arrive" else until + 1e-9, kind, payload)
        return True

    def _push(self, t: float, kind: str, payload) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))

    def pump(self, addr) -> None:
        """Route everything ``addr``'s engine wants to send now and re-arm its timer."""
        eng = self.hosts[addr]
        for tx in eng.datagrams_to_send(self.now):
            for dgram in self._in_wire_order(tx):
                self._transmit(addr, tx.addr, dgram)
        self._arm(addr)

    def _in_wire_order(self, tx) -> list:
        """``tx``'s datagrams in the order they leave: its parts interleaved, last part first, where the network
        plays sender threads (:attr:`interleave_parts`), else as built."""
        dgrams = tx.datagrams()
        parts = getattr(tx, "parts", 1)
        if not self.interleave_parts or parts <= 1:
            return dgrams
        n = len(dgrams)
        lanes = [dgrams[n * k // parts:n * (k + 1) // parts] for k in reversed(range(parts))]
        return [lane[i] for i in range(max(map(len, lanes))) for lane in lanes if i < len(lane)]

    def _arm(self, addr) -> None:
        t = self.hosts[addr].get_timer()
        self._timer_version[addr] += 1
        if t is not None:
            self._push(max(t, self.now), "timer", (addr, self._timer_version[addr]))

    def _transmit(self, src, dst, data: bytes) -> None:
        if dst not in self.hosts:
            return
        link = self.link(src, dst)
        link.stats["sent"] += 1
        if link.drop_if is not None and link.drop_if(data):
            link.stats["lost"] += 1
            return
        if len(data) > link.loss_min_size and link.loss and self.rng.random() < link.loss:
            link.stats["lost"] += 1
            return
        copies = 2 if link.duplicate and self.rng.random() < link.duplicate else 1
        if copies == 2:
            link.stats["dup"] += 1
        for _ in range(copies):
            start = max(self.now, link.busy_until)
            if link.rate:
                if link.queue_bytes is not None and (start - self.now) * link.rate > link.queue_bytes:
                    link.stats["queue_drop"] += 1
                    continue
                link.busy_until = start + (len(data) + IP_UDP_HEADER_BYTES) / link.rate
                depart = link.busy_until
            else:
                depart = self.now
            jitter = self.rng.uniform(0, link.jitter_s) if link.jitter_s else 0.0
            self._push(depart + link.delay_s + jitter, "arrive", (src, dst, data))

    def start(self) -> None:
        """Pump every host once (after commands were issued at ``now``)."""
        for addr in self.hosts:
            if self._stalled_until(addr) is None:  # a stalled host runs nothing until it resumes
                self.pump(addr)

    def run(self, until: float | None = None, *, stop=None, max_events: int = 5_000_000) -> float:
        """Run until ``until`` (virtual seconds), until ``stop()`` is true, or no event is left."""
        self.start()
        n = 0
        while self._heap and n < max_events:
            t, _, kind, payload = self._heap[0]
            if until is not None and t > until:
                self.now = until
                break
            heapq.heappop(self._heap)
            self.now = max(self.now, t)
            n += 1
            if kind == "arrive":
                src, dst, data = payload
                if self._deferred(dst, kind, payload):
                    continue
                if self.trace is not None:
                    self.trace.append((self.now, src, dst, data))
                self.hosts[dst].receive_datagram(data, src, self.now)
                self.pump(dst)
            elif kind == "resume":
                if self._stalled_until(payload) is None:  # not stalled again meanwhile (that stall resumes it)
                    self.pump(payload)
            else:
                addr, version = payload
                if version != self._timer_version[addr]:
                    continue
                if self._deferred(addr, kind, payload):
                    continue
                if self.now == self._last_fire.get(addr):
                    self._same_fire[addr] = self._same_fire.get(addr, 0) + 1
                    if self._same_fire[addr] > 1000:
                        raise RuntimeError(f"timer livelock: {addr} keeps asking for a timer at t={self.now}")
                else:
                    self._same_fire[addr] = 0
                self._last_fire[addr] = self.now
                self.hosts[addr].handle_timer(self.now)
                self.pump(addr)
            if stop is not None and stop():
                break
        return self.now
