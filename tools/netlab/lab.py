"""The lab: hosts in network namespaces behind a bridge "ToR switch", with impairments.

Theory of operation
    Topology. One namespace ``<prefix>-sw`` holds the switch: a single bridge ``ltpbr0`` or,
    with ``racks=[a, b, ...]``, one bridge per rack (``ltpbrR``) joined by veth uplinks
    (``ltpuR`` <-> ``ltpsR``) to a spine bridge ``ltpspine``. Each host is a namespace
    ``<prefix>-hI`` with one veth ``ltpeth0`` (address ``10.77.0.(I+1)/24``) whose peer
    ``ltppI`` is a bridge port in the switch namespace. The veth pair is created inside the
    switch namespace and one end moved out, so the root namespace is never touched.
    IPv6 is off everywhere (no stray router solicitations in the counters).

    Offloads. TSO/GSO/GRO and the UDP segmentation offloads are off on every lab veth, so
    the sender's stack segments GSO super-packets before they leave the host and every loss
    point sees wire-sized packets. An nft counter (``oversize``: length > MTU) at each loss
    point verifies this; :meth:`Lab.loss_stats` reports it.

    Receive GRO (``gro=True``, a choice for measuring what a real host pays). A real NIC's
    driver runs GRO on what it receives; a veth without it hands every datagram to the socket
    alone, which costs a UDP receiver (one socket enqueue and one ``recvmmsg`` slot per
    datagram) far more than a TCP receiver (which coalesces in its receive queue). With
    ``gro=True`` each host's ``ltpeth0`` has GRO on (veth then receives through NAPI and
    coalesces TCP segments, and the datagrams of a socket that set ``UDP_GRO``); everything
    else stays off, so packets still cross the switch wire-sized. GRO runs before the host's
    netdev ingress hook, so the *ingress* loss point moves to the switch: an nft netdev
    **egress** hook on the host's downlink ``ltppI``, which runs before that port's qdisc.
    Loss then precedes the downlink's rate limit (a packet lost there takes no tbf tokens);
    without ``gro`` the rate limit comes first. The loss rule, its counters and the
    ``oversize`` check are otherwise the same.

    Where each impairment lives ("ingress" = traffic INTO host h, "egress" = OUT of h):

        =========  ===================================  ====================================
        impairment ingress                              egress
        =========  ===================================  ====================================
        loss       nft netdev ingress hook on ltpeth0   nft netdev ingress hook on ltppI
                   (host namespace)                     (switch namespace)
        rate       tbf on ltppI (the host's DOWNLINK,   tbf on ltpeth0 (the host's uplink;
                   bridge-side veth egress)             GSO packets still whole there, so
                                                        the tbf queues them frame by frame)
        delay      nfqueue: C delayer in the switch     nfqueue: C delayer in the switch
                   namespace, FORWARD of bridged        namespace, PREROUTING of bridged
                   packets out of ltppI (physdev-out);  packets (br_netfilter, physdev-in);
                   netem: netem under the downlink tbf  netem: netem on ltpeth0
        =========  ===================================  ====================================

    The delayer always sits on the receiving side of the impaired hop: a packet held on the
    sender's egress stays charged to its TCP socket and TCP throttles itself (TSQ). It never
    sits in the receiving host: the kernel stamps a datagram's arrival (``SO_TIMESTAMPNS``)
    when it enters the host, before a PREROUTING hook there, so a delayer in the host made
    every receive timestamp early by the delay (``Lab._delay_point``). The loss rule is the
    same for every transport: drop IPv4 packets longer than 200 bytes (data, not ACKs) with
    probability ``loss`` using ``numgen random``; ``all_sizes=True`` drops every IPv4 packet.
    Order on the downlink path: delay (switch, as the packet is forwarded to the port), rate
    (tbf on the port), then loss (at the host; with ``gro``, at the port before the tbf).

    Cleanup. :meth:`Lab.close` (run by ``__exit__``, by SIGTERM and SIGHUP handlers installed while
    the lab is open, and by ``atexit``) kills every process in the lab's namespaces and deletes
    the namespaces, which removes all links, qdiscs and rules. ``support.clean(prefix)``
    does the same for leftovers of crashed runs.
"""
from __future__ import annotations

import atexit
import dataclasses
import ipaddress
import json
import os
import secrets
import signal
import subprocess
import threading
from typing import Sequence

from . import support
from .delayer import start_delayer
from .support import LabUnsupported

HOST_IF = "ltpeth0"
ETH_HLEN = 14  # bytes of Ethernet header on a veth
DATA_MIN_IP_LEN = 200  # bytes; packets longer than this are "data" for the default loss rule
LOSS_SCALE = 1_000_000  # numgen modulus: loss probability resolution 1e-6
OFFLOADS_OFF = ["tso", "off", "gso", "off", "gro", "off", "tx-udp-segmentation", "off",
                "rx-gro-list", "off", "rx-udp-gro-forwarding", "off"]
#: a host interface of a ``gro=True`` lab: the same, but receive GRO on (as a NIC's driver does)
OFFLOADS_HOST_GRO = OFFLOADS_OFF[:4] + ["gro", "on"] + OFFLOADS_OFF[6:]
DIRECTIONS = ("ingress", "egress")
# signals that end a process holding a (non-persistent) lab: the lab turns them into SystemExit so that its
# namespaces are removed on the way out (SIGHUP: the terminal or session that started the run went away)
CLEANUP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


#: the most bytes a tbf bucket holds: a transfer of ``S`` bytes can beat the rate by at most this much
#: (3 % of a 2 MB transfer), whatever the timer tick (0.5 ms of tokens at 1 Gbit/s)
TBF_MAX_BURST_BYTES = 64 * 1024
#: the peak rate of every lab tbf's one-frame peak bucket (``Lab._add_tbf``): far above any lab rate, so it
#: delays no frame (one 1514-byte frame per 12 ns) and only makes tbf queue GSO packets frame by frame
TBF_PEAK_RATE_BPS = 1e12


def tbf_queue_bytes(rate_bps: float, wire: int) -> int:
    """Bytes of a lab tbf's queue when none is asked for: 5 ms of ``rate_bps``, at least 10 frames of ``wire`` bytes."""
    return max(10 * wire, int(rate_bps / 8 * 0.005))


def tbf_burst(rate_bps: float, wire: int, hz: int | None = None) -> int:
    """Bytes of tbf bucket for ``rate_bps``: one kernel timer tick of tokens (tc-tbf(8): "the minimum buffer
    size can be calculated by dividing the rate by HZ"), at most :data:`TBF_MAX_BURST_BYTES`, at least two
    frames of ``wire`` bytes.

    *Choice* (2026-12-03): the bucket was 200 us of tokens, which a machine whose qdisc wakes late cannot
    use: kernel TCP then reached 0.43-0.61 of a 100-200 Mbit/s tbf (1 ms: 0.72-0.95), and the lab's rates
    were not the rates asked for.  One whole tick (4 ms at HZ=250) reached them (0.93-0.96; 1448/1514 =
    0.956 is the payload share) but let a 2 MB transfer through a 1 Gbit/s tbf at 1.23 Gbit/s, the
    bucket's 500 kB passing at veth speed.  Capped at 64 kB: 0.95-0.96 at 100 Mbit/s, 200 Mbit/s and 1 Gbit/s
    (100 MB), and 0.79-0.89 for the 2 MB transfer."""
    return max(2 * wire, min(TBF_MAX_BURST_BYTES, int(rate_bps / 8 / (hz or support.kernel_hz()))))


@dataclasses.dataclass(frozen=True)
class Host:
    """One lab host: a network namespace with one interface on the switch."""

    name: str      # "h0", "h1", ...
    netns: str     # namespace name, e.g. "ltplab-3fa2c1-h0"
    addr: str      # IPv4 address without prefix length, e.g. "10.77.0.1"
    ifname: str    # the host's interface inside its namespace ("ltpeth0")
    index: int     # position in Lab.hosts
    rack: int      # rack number (0 for a single-tier lab)
    port: str      # the switch-side veth (in the switch namespace) = the host's downlink


@dataclasses.dataclass
class Impairment:
    """The impairment currently applied to one (host, direction)."""

    loss: float = 0.0
    rate_bps: float | None = None
    queue_bytes: int | None = None
    delay_s: float = 0.0
    jitter_s: float = 0.0
    all_sizes: bool = False


class Lab:
    """A set of hosts (network namespaces) behind a bridge switch, with per-host impairments.

    Use as a context manager; everything is removed on exit, also on exceptions, Ctrl-C,
    SIGTERM and SIGHUP. ``racks`` (e.g. ``[2, 2]``) builds a two-tier topology and overrides
    ``n_hosts`` with ``sum(racks)``. ``prefix`` names every namespace (default
    ``"ltplab-" + 6 random hex digits``). ``persistent=True`` keeps the lab after the
    process exits (used by ``ltp-lab up``; remove it with :func:`destroy` / ``ltp-lab down``).
    ``gro=True`` turns receive GRO on at every host's interface and moves the ingress loss
    point to the switch (see the module docstring).
    """

    def __init__(self, n_hosts: int = 3, racks: Sequence[int] | None = None, prefix: str | None = None,
                 mtu: int = 1500, subnet: str = "10.77.0.0/24", persistent: bool = False, gro: bool = False):
        if racks is not None:
            racks = [int(r) for r in racks]
            if not racks or any(r < 1 for r in racks):
                raise ValueError(f"racks must be a non-empty list of positive host counts, got {racks}")
            n_hosts = sum(racks)
        if n_hosts < 1:
            raise ValueError(f"n_hosts must be >= 1, got {n_hosts}")
        net = ipaddress.ip_network(subnet)
        if n_hosts > net.num_addresses - 2:
            raise ValueError(f"{n_hosts} hosts do not fit in {subnet}")
        if not 576 <= mtu <= 9000:
            raise ValueError(f"mtu must be in 576..9000, got {mtu}")
        self.prefix = prefix if prefix is not None else f"{support.DEFAULT_PREFIX}{secrets.token_hex(3)}"
        self.racks = list(racks) if racks else None
        self.mtu = mtu
        self.subnet = net
        self.persistent = persistent
        self.gro = bool(gro)
        self.switch_ns = f"{self.prefix}-sw"
        rack_of = []
        for r, count in enumerate(self.racks or [n_hosts]):
            rack_of += [r] * count
        hosts = net.hosts()
        self.hosts: list[Host] = [
            Host(name=f"h{i}", netns=f"{self.prefix}-h{i}", addr=str(next(hosts)), ifname=HOST_IF,
                 index=i, rack=rack_of[i], port=f"ltpp{i}")
            for i in range(n_hosts)]
        self._impair: dict[tuple[int, str], Impairment] = {}
        self._uplinks: dict[tuple[int, str], Impairment] = {}  # (rack, "up"|"down") -> rate/delay of the uplink
        self._uplink_delayers: dict[tuple[int, str], subprocess.Popen] = {}
        self._blocked: set = set()  # frozenset({addr_a, addr_b}) pairs whose traffic the switch drops
        self._redrawers: list = []
        self._delayers: dict[tuple[int, str], subprocess.Popen] = {}
        self._procs: list[subprocess.Popen] = []
        self._created: list[str] = []
        self._open = False
        self._old_handlers: dict = {}  # signal -> the handler this lab replaced
        self._delay_backend: str | None = None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Lab":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        if not self.persistent:
            self.close()

    def start(self) -> "Lab":
        """Create namespaces, links, addresses and counters (done by ``__enter__``)."""
        problem = support.check_support()
        if problem:
            raise LabUnsupported(problem)
        existing = support.list_netns(self.prefix + "-")
        if existing:
            raise RuntimeError(f"namespaces with prefix {self.prefix!r} already exist ({existing}); "
                               f"remove them with `ltp-lab clean --prefix {self.prefix}`")
        self._open = True
        if not self.persistent:
            support.claim(self.prefix)  # `ltp-lab clean` leaves a lab alone while this process runs it
            atexit.register(self.close)
            if threading.current_thread() is threading.main_thread():
                for sig in CLEANUP_SIGNALS:
                    old = signal.getsignal(sig)
                    if old in (signal.SIG_DFL, None):
                        signal.signal(sig, _raise_system_exit)
                        self._old_handlers[sig] = old
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Kill every process in the lab and delete its namespaces. Idempotent."""
        if not self._open:
            return
        self._open = False
        for r in self._redrawers:
            r.stop()
        self._redrawers.clear()
        for p in list(self._delayers.values()) + list(self._uplink_delayers.values()) + self._procs:
            _terminate(p)
        self._delayers.clear()
        self._uplink_delayers.clear()
        self._procs.clear()
        for name in reversed(self._created):
            support.kill_netns_pids(name)
            support.netns_del(name)
        self._created.clear()
        if not self.persistent:
            support.release(self.prefix)
        for sig, old in self._old_handlers.items():
            try:
                signal.signal(sig, old if old is not None else signal.SIG_DFL)
            except ValueError:
                pass
        self._old_handlers.clear()
        try:
            atexit.unregister(self.close)
        except Exception:  # noqa: BLE001
            pass

    def _build(self) -> None:
        for name in [self.switch_ns] + [h.netns for h in self.hosts]:
            self._created.append(name)
            support.netns_add(name)
        sw_cmds = ["sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1",
                   "sysctl -qw net.bridge.bridge-nf-call-iptables=0 net.bridge.bridge-nf-call-ip6tables=0 "
                   "net.bridge.bridge-nf-call-arptables=0"]
        self._sh(self.switch_ns, sw_cmds[:1])
        self._sh(self.switch_ns, sw_cmds[1:], check=False)  # no br_netfilter: nothing to turn off
        for h in self.hosts:
            self._sh(h.netns, ["sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1"])
        mtu = self.mtu
        with support.iproute(self.switch_ns) as ipr:
            def up(ifname, **kw):
                ipr.link("set", index=ipr.link_lookup(ifname=ifname)[0], state="up", mtu=mtu, **kw)

            bridges = []
            if self.racks:
                ipr.link("add", ifname="ltpspine", kind="bridge", br_stp_state=0, br_forward_delay=0)
                bridges.append("ltpspine")
                for r in range(len(self.racks)):
                    ipr.link("add", ifname=f"ltpbr{r}", kind="bridge", br_stp_state=0, br_forward_delay=0)
                    bridges.append(f"ltpbr{r}")
            else:
                ipr.link("add", ifname="ltpbr0", kind="bridge", br_stp_state=0, br_forward_delay=0)
                bridges.append("ltpbr0")
            for b in bridges:
                up(b)
            if self.racks:
                for r in range(len(self.racks)):
                    ipr.link("add", ifname=f"ltpu{r}", kind="veth", peer=f"ltps{r}")
                    up(f"ltpu{r}", master=ipr.link_lookup(ifname=f"ltpbr{r}")[0])
                    up(f"ltps{r}", master=ipr.link_lookup(ifname="ltpspine")[0])
            for h in self.hosts:
                bridge = f"ltpbr{h.rack}" if self.racks else "ltpbr0"
                # pyroute2 resolves a namespace *name* in its helper's mount namespace, where
                # /run/netns may not show it: hand it an fd opened here instead
                fd = os.open(f"/run/netns/{h.netns}", os.O_RDONLY)
                try:
                    ipr.link("add", ifname=h.port, kind="veth", peer={"ifname": h.ifname, "net_ns_fd": fd})
                finally:
                    os.close(fd)
                up(h.port, master=ipr.link_lookup(ifname=bridge)[0])
        sw_ifs = [h.port for h in self.hosts] + (
            [f"ltpu{r}" for r in range(len(self.racks))] + [f"ltps{r}" for r in range(len(self.racks))]
            if self.racks else [])
        self._sh(self.switch_ns, [f"ethtool -K {i} {' '.join(OFFLOADS_OFF)}" for i in sw_ifs])
        for h in self.hosts:
            with support.iproute(h.netns) as ipr:
                ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
                idx = ipr.link_lookup(ifname=h.ifname)[0]
                ipr.link("set", index=idx, mtu=mtu)
                ipr.addr("add", index=idx, address=h.addr, prefixlen=self.subnet.prefixlen)
                ipr.link("set", index=idx, state="up")
            self._sh(h.netns, [f"ethtool -K {h.ifname} {' '.join(OFFLOADS_HOST_GRO if self.gro else OFFLOADS_OFF)}"])
            for d in DIRECTIONS:
                ns, table = self._loss_point(h, d)
                self._nft(ns, _counter_table(table, h.port if ns == self.switch_ns else h.ifname, self._loss_hook(d)))
            for d in DIRECTIONS:
                self._set_loss_rules(h, d, Impairment())

    # ------------------------------------------------------------------ helpers
    def _sh(self, ns: str, cmds: list[str], check: bool = True) -> None:
        if not cmds:
            return
        r = support._ns_exec(ns, ["sh", "-ec", "\n".join(cmds)])
        if check and r.returncode != 0:
            raise RuntimeError(f"in namespace {ns}: {cmds!r} failed: {r.stderr.strip()}")

    def _nft(self, ns: str, script: str) -> None:
        r = support._ns_exec(ns, ["nft", "-f", "-"], input=script)
        if r.returncode != 0:
            raise RuntimeError(f"nft failed in {ns}: {r.stderr.strip()}\nscript:\n{script}")

    def _host(self, h: Host | int | str) -> Host:
        if isinstance(h, Host):
            return self.hosts[h.index]
        if isinstance(h, int):
            return self.hosts[h]
        for x in self.hosts:
            if h in (x.name, x.netns, x.addr):
                return x
        raise KeyError(f"no host {h!r} in lab {self.prefix} (hosts: {[x.name for x in self.hosts]})")

    def _loss_point(self, h: Host, direction: str) -> tuple[str, str]:
        """(namespace, nft table) of the loss point of (h, direction)."""
        if direction == "egress":
            return self.switch_ns, f"ltplab_{h.name}"
        # with receive GRO the host's own ingress hook would see coalesced packets: drop on the downlink
        return (self.switch_ns, f"ltplab_{h.name}_down") if self.gro else (h.netns, "ltplab")

    def _loss_hook(self, direction: str) -> str:
        """The nft netdev hook of the loss point of ``direction`` (see :meth:`_loss_point`)."""
        return "egress" if (self.gro and direction == "ingress") else "ingress"

    # ------------------------------------------------------------------ impairments
    @property
    def backend(self) -> str:
        """The impairment backend, e.g. ``"nftables+tbf+nfqueue-delayer"`` or ``"nftables+tbf+netem"``."""
        d = self._delay_backend or support.delay_backend()
        delay = {"netem": "netem", "nfqueue": "nfqueue-delayer"}.get(d, "no-delay")
        return f"nftables+tbf+{delay}"

    def impair(self, h: Host | int | str, direction: str = "ingress", loss: float = 0.0,
               rate_bps: float | None = None, queue_bytes: int | None = None, delay_s: float = 0.0,
               jitter_s: float = 0.0, all_sizes: bool = False) -> None:
        """Set the impairments of host ``h`` in ``direction``, replacing earlier ones there.

        ``direction``: ``"ingress"`` (traffic into the host: loss/delay at the host's ingress,
        rate on its downlink), ``"egress"`` (traffic out of the host), or ``"both"``.
        ``loss``: drop probability 0..1 of IPv4 packets longer than 200 bytes (every IPv4
        packet with ``all_sizes=True``). ``rate_bps``: tbf rate in bit/s (L2 bytes count), with
        a queue of ``queue_bytes`` (default: 5 ms at that rate, at least 10 MTU-sized packets).
        ``delay_s`` ± ``jitter_s``: one-way delay, uniform jitter (reorders like netem).
        Calling with only the defaults removes the impairments of that direction. The loss
        counters of that direction restart from zero, so :meth:`loss_stats` compares the
        measured loss with exactly this setting.
        """
        if direction == "both":
            for d in DIRECTIONS:
                self.impair(h, d, loss, rate_bps, queue_bytes, delay_s, jitter_s, all_sizes)
            return
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be 'ingress', 'egress' or 'both', got {direction!r}")
        if not 0.0 <= loss <= 1.0:
            raise ValueError(f"loss is a probability in [0, 1], got {loss}")
        if rate_bps is not None and rate_bps <= 0:
            raise ValueError(f"rate_bps must be positive or None, got {rate_bps}")
        if delay_s < 0 or jitter_s < 0 or jitter_s > delay_s:
            raise ValueError(f"need 0 <= jitter_s <= delay_s, got delay_s={delay_s} jitter_s={jitter_s}")
        if not self._open:
            raise RuntimeError("the lab is not running (use it inside `with Lab(...) as lab:`)")
        h = self._host(h)
        new = Impairment(loss, rate_bps, queue_bytes, delay_s, jitter_s, all_sizes)
        old = self._impair.get((h.index, direction), Impairment())
        delay_changed = (new.delay_s, new.jitter_s) != (old.delay_s, old.jitter_s)
        if delay_changed or (new.rate_bps, new.queue_bytes) != (old.rate_bps, old.queue_bytes):
            self._set_qdisc_and_delay(h, direction, new, delay_changed)
        self._set_loss_rules(h, direction, new)
        self._impair[(h.index, direction)] = new
        self.reset_stats(h, direction)

    def clear(self, h: Host | int | str) -> None:
        """Remove all impairments (both directions) of host ``h``."""
        for d in DIRECTIONS:
            self.impair(h, d)

    def _add_tbf(self, ns: str, ifname: str, rate_bps: float, queue_bytes: int | None) -> str:
        """The root tbf of ``ifname`` in namespace ``ns`` (a host port, a host's own interface or a two-tier
        uplink): ``rate_bps``, a queue of ``queue_bytes`` (default 5 ms of the rate, at least 10 frames), a
        :func:`tbf_burst` bucket, and a peak-rate bucket of one frame (:data:`TBF_PEAK_RATE_BPS`) so that
        every packet enters the queue frame by frame; returns the parent handle a netem goes under.

        *Why the peak bucket* (2026-12-03, session 42): tbf queues a packet no larger than its bucket whole
        and takes a larger GSO packet apart into its segments.  On a host's own interface a UDP-GSO batch or
        a TCP super-packet reaches the qdisc before it is segmented, so with the 64 kB bucket over the incast
        row's 32 kB queue every batch between those sizes was dropped entire: an LTP transfer out of such a
        host got 50 of 119,712 packets through and failed, kernel bbr ran at 8-15 Mbit/s, and the incast
        row's PS could not answer its workers.  A peak bucket of one frame caps tbf's largest packet at one
        frame, so every batch is segmented and each frame meets the queue on its own, as at a switch port;
        at a peak rate far above the link's it never delays a frame.  pyroute2 does not send tbf's peak
        rate, so this qdisc is made with iproute2's ``tc``."""
        wire = self.mtu + ETH_HLEN
        qbytes = queue_bytes if queue_bytes is not None else tbf_queue_bytes(rate_bps, wire)
        peak = max(TBF_PEAK_RATE_BPS, 10 * rate_bps)
        self._sh(ns, [f"tc qdisc add dev {ifname} root handle 1: tbf rate {int(rate_bps)}bit "
                      f"burst {tbf_burst(rate_bps, wire)} limit {max(qbytes, wire)} peakrate {int(peak)}bit mtu {wire}"])
        return "1:1"

    def impairment(self, h: Host | int | str, direction: str = "ingress") -> Impairment:
        """The impairment currently set on (h, direction)."""
        return dataclasses.replace(self._impair.get((self._host(h).index, direction), Impairment()))

    def _set_loss_rules(self, h: Host, direction: str, imp: Impairment) -> None:
        ns, table = self._loss_point(h, direction)
        match = "meta protocol ip" if imp.all_sizes else f"ip length > {DATA_MIN_IP_LEN}"
        # an ingress hook sees the packet after its Ethernet header was pulled, an egress hook with it
        longest = self.mtu + (ETH_HLEN if self._loss_hook(direction) == "egress" else 0)
        rules = [f"flush chain netdev {table} lossy",
                 f'add rule netdev {table} lossy meta length > {longest} counter name "oversize"',
                 f'add rule netdev {table} lossy {match} counter name "seen"']
        threshold = round(imp.loss * LOSS_SCALE)
        if threshold >= LOSS_SCALE:
            rules.append(f'add rule netdev {table} lossy {match} counter name "dropped" drop')
        elif threshold > 0:
            rules.append(f'add rule netdev {table} lossy {match} numgen random mod {LOSS_SCALE} < {threshold} '
                         f'counter name "dropped" drop')
        self._nft(ns, "\n".join(rules) + "\n")

    def _set_qdisc_and_delay(self, h: Host, direction: str, imp: Impairment, delay_changed: bool) -> None:
        from pyroute2.netlink.exceptions import NetlinkError

        backend = support.delay_backend()
        if imp.delay_s > 0 and backend == "none":
            raise LabUnsupported(support.delay_unavailable_reason())
        self._delay_backend = backend
        # rate (and, for netem, delay) live on the egress qdisc of one veth end
        rate_ns, rate_if = (self.switch_ns, h.port) if direction == "ingress" else (h.netns, h.ifname)
        use_netem = backend == "netem" and imp.delay_s > 0
        with support.iproute(rate_ns) as ipr:
            idx = ipr.link_lookup(ifname=rate_if)[0]
            try:
                ipr.tc("del", index=idx, handle="1:", root=True)
            except NetlinkError:
                pass  # no root qdisc yet
            parent = self._add_tbf(rate_ns, rate_if, imp.rate_bps, imp.queue_bytes) if imp.rate_bps else None
            if use_netem:
                kw = dict(delay=int(imp.delay_s * 1e6), jitter=int(imp.jitter_s * 1e6), limit=1_000_000)
                if parent:
                    ipr.tc("add", "netem", index=idx, parent=parent, handle="10:", **kw)
                else:
                    ipr.tc("add", "netem", index=idx, handle="1:", **kw)
        if not delay_changed or (backend != "nfqueue" and (h.index, direction) not in self._delayers):
            return  # a running delayer keeps its held packets when only the rate changes
        # user-space delayer: in the switch, on the receiving side of the impaired hop
        self._stop_delayer(h, direction)
        if imp.delay_s > 0 and backend == "nfqueue":
            ns, queue, table, chain, rule = self._delay_point(h, direction)
            self._sh(ns, ["sysctl -qw net.bridge.bridge-nf-call-iptables=1"])
            self._delayers[(h.index, direction)] = start_delayer(
                ns, queue, imp.delay_s, imp.jitter_s, seed=1 + 2 * h.index + (direction == "egress"))
            r = support._ns_exec(ns, ["iptables-legacy", "-t", table, "-A", chain, *rule,
                                      "-j", "NFQUEUE", "--queue-num", str(queue)])
            if r.returncode != 0:
                self._stop_delayer(h, direction)
                raise RuntimeError(f"iptables-legacy NFQUEUE rule failed in {ns}: {r.stderr.strip()}")

    def _delay_point(self, h: Host, direction: str) -> tuple:
        """(namespace, NFQUEUE number, iptables table, chain, match) of the user-space delayer of (h, direction).

        Both directions delay bridged packets in the switch namespace: ingress (to h) as the switch forwards
        them out of h's port (FORWARD, ``--physdev-out``), egress (from h) as they enter it (PREROUTING,
        ``--physdev-in``). Not in the host: the kernel stamps a packet's receive time (``SO_TIMESTAMPNS``) when
        it enters the host, before a PREROUTING delayer holds it, so a delayer there made every timestamp
        early by the whole delay (LTP's RTT samples at a host with ingress delay read ~0 instead of the
        delay). Crossing the veth into the host namespace clears the stamp, so the host stamps the packet
        when it really arrives, as a NIC does at the end of a long link."""
        if direction == "ingress":
            return (self.switch_ns, INGRESS_QUEUE_BASE + h.index, "mangle", "FORWARD",
                    ["-m", "physdev", "--physdev-out", h.port, "--physdev-is-bridged"])
        return self.switch_ns, h.index + 1, "raw", "PREROUTING", ["-m", "physdev", "--physdev-in", h.port]

    def _stop_delayer(self, h: Host, direction: str) -> None:
        p = self._delayers.pop((h.index, direction), None)
        if p is None:
            return
        ns, queue, table, chain, rule = self._delay_point(h, direction)
        support._ns_exec(ns, ["iptables-legacy", "-t", table, "-D", chain, *rule,
                              "-j", "NFQUEUE", "--queue-num", str(queue)])
        _terminate(p)

    # ------------------------------------------------------------------ racks, blocks, redraws
    def uplink(self, rack: int, rate_bps: float | None = None, delay_s: float = 0.0, direction: str = "both",
               queue_bytes: int | None = None) -> None:
        """Rate (tbf, bit/s) and one-way delay (seconds) of rack ``rack``'s uplink to the spine.

        ``direction``: ``"up"`` (rack -> spine, shaped on the rack side of the uplink veth),
        ``"down"`` (spine -> rack) or ``"both"``. Calling with the defaults removes them.
        Needs ``racks=[...]``. Delay uses netem where available, else the user-space delayer
        on the receiving bridge port (bridged PREROUTING, like a host's egress delay).
        """
        if direction == "both":
            for d in ("up", "down"):
                self.uplink(rack, rate_bps, delay_s, d, queue_bytes)
            return
        if not self.racks:
            raise ValueError("uplinks exist only in a two-tier lab: build it with Lab(racks=[a, b, ...])")
        if not 0 <= rack < len(self.racks):
            raise ValueError(f"no rack {rack}; this lab has racks 0..{len(self.racks) - 1}")
        if direction not in ("up", "down"):
            raise ValueError(f"direction must be 'up', 'down' or 'both', got {direction!r}")
        if rate_bps is not None and rate_bps <= 0:
            raise ValueError(f"rate_bps must be positive or None, got {rate_bps}")
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        if not self._open:
            raise RuntimeError("the lab is not running (use it inside `with Lab(...) as lab:`)")
        from pyroute2.netlink.exceptions import NetlinkError

        new = Impairment(rate_bps=rate_bps, queue_bytes=queue_bytes, delay_s=delay_s)
        old = self._uplinks.get((rack, direction), Impairment())
        backend = support.delay_backend() if delay_s > 0 else "netem"
        if delay_s > 0 and backend == "none":
            raise LabUnsupported(support.delay_unavailable_reason())
        # up: rack bridge -> spine leaves through ltpu<r>; down: spine -> rack leaves through ltps<r>
        shape_if, recv_port = (f"ltpu{rack}", f"ltps{rack}") if direction == "up" else (f"ltps{rack}", f"ltpu{rack}")
        with support.iproute(self.switch_ns) as ipr:
            idx = ipr.link_lookup(ifname=shape_if)[0]
            try:
                ipr.tc("del", index=idx, handle="1:", root=True)
            except NetlinkError:
                pass
            parent = self._add_tbf(self.switch_ns, shape_if, rate_bps, queue_bytes) if rate_bps else None
            if delay_s > 0 and backend == "netem":
                kw = dict(delay=int(delay_s * 1e6), limit=1_000_000)
                ipr.tc("add", "netem", index=idx, **(dict(parent=parent, handle="10:") if parent else
                                                       dict(handle="1:")), **kw)
        if (new.delay_s != old.delay_s) or (rack, direction) in self._uplink_delayers:
            self._stop_uplink_delayer(rack, direction)
            if delay_s > 0 and backend == "nfqueue":
                queue = UPLINK_QUEUE_BASE + 2 * rack + (direction == "down")
                self._sh(self.switch_ns, ["sysctl -qw net.bridge.bridge-nf-call-iptables=1"])
                self._uplink_delayers[(rack, direction)] = start_delayer(self.switch_ns, queue, delay_s, 0.0,
                                                                         seed=queue)
                r = support._ns_exec(self.switch_ns, ["iptables-legacy", "-t", "raw", "-A", "PREROUTING", "-m",
                                                      "physdev", "--physdev-in", recv_port, "-j", "NFQUEUE",
                                                      "--queue-num", str(queue)])
                if r.returncode != 0:
                    self._stop_uplink_delayer(rack, direction)
                    raise RuntimeError(f"iptables-legacy NFQUEUE rule for uplink {rack} failed: {r.stderr.strip()}")
        self._uplinks[(rack, direction)] = new

    def _stop_uplink_delayer(self, rack: int, direction: str) -> None:
        p = self._uplink_delayers.pop((rack, direction), None)
        if p is None:
            return
        queue = UPLINK_QUEUE_BASE + 2 * rack + (direction == "down")
        recv_port = f"ltps{rack}" if direction == "up" else f"ltpu{rack}"
        support._ns_exec(self.switch_ns, ["iptables-legacy", "-t", "raw", "-D", "PREROUTING", "-m", "physdev",
                                          "--physdev-in", recv_port, "-j", "NFQUEUE", "--queue-num", str(queue)])
        _terminate(p)

    def uplink_specs(self) -> list[dict]:
        """``[{rack, up_bps, down_bps, delay_s}]`` for racks with a shaped or delayed uplink."""
        out = []
        for r in range(len(self.racks or [])):
            up, down = self._uplinks.get((r, "up")), self._uplinks.get((r, "down"))
            if up is None and down is None:
                continue
            out.append({"rack": r, "up_bps": up.rate_bps if up else None, "down_bps": down.rate_bps if down else None,
                        "delay_s": max(x.delay_s for x in (up, down) if x is not None)})
        return out

    def block(self, a: Host | int | str, b: Host | int | str) -> None:
        """Drop every packet between hosts ``a`` and ``b`` (both directions) at the switch, mid-run."""
        ha, hb = self._host(a), self._host(b)
        if ha.index == hb.index:
            raise ValueError(f"block needs two different hosts, got {ha.name} twice")
        self._blocked.add(frozenset((ha.addr, hb.addr)))
        self._apply_blocks()

    def unblock(self, a: Host | int | str, b: Host | int | str) -> None:
        """Let ``a`` and ``b`` talk again."""
        self._blocked.discard(frozenset((self._host(a).addr, self._host(b).addr)))
        self._apply_blocks()

    def blocked_pairs(self) -> list[tuple[str, str]]:
        """Blocked pairs as host names (sorted), for ``Topology.from_lab``."""
        names = {h.addr: h.name for h in self.hosts}
        return sorted(tuple(sorted(names[x] for x in p)) for p in self._blocked)

    def _apply_blocks(self) -> None:
        if not self._open:
            raise RuntimeError("the lab is not running (use it inside `with Lab(...) as lab:`)")
        lines = ["table bridge ltpblock {",
                 "  chain forward { type filter hook forward priority 0; policy accept; }", "}",
                 "flush chain bridge ltpblock forward"]
        for p in sorted(self._blocked, key=sorted):
            x, y = sorted(p)
            lines.append(f"add rule bridge ltpblock forward ip saddr {x} ip daddr {y} counter drop")
            lines.append(f"add rule bridge ltpblock forward ip saddr {y} ip daddr {x} counter drop")
        self._nft(self.switch_ns, "\n".join(lines) + "\n")

    def redraw_rates(self, hosts: Sequence, period_s: float, draw, *, seed: int = 0,
                     direction: str = "egress") -> "RateRedrawer":
        """Every ``period_s`` seconds set each host's rate in ``direction`` to ``draw(rng)`` bit/s.

        ``draw`` is any function of a seeded ``random.Random`` (e.g. a skewed profile such as
        MLfabric's); loss and delay already set on that direction are kept. The first draw
        happens now. Returns the running :class:`RateRedrawer` (``stop()``, ``history``);
        :meth:`close` stops it.
        """
        if period_s <= 0:
            raise ValueError(f"period_s must be > 0, got {period_s}")
        r = RateRedrawer(self, [self._host(h) for h in hosts], period_s, draw, seed, direction)
        self._redrawers.append(r)
        r.start()
        return r

    # ------------------------------------------------------------------ measurement
    def loss_stats(self, h: Host | int | str, direction: str = "ingress") -> dict:
        """Counters at the loss point of (h, direction) since the last :meth:`impair` there (or :meth:`reset_stats`).

        Returns ``dict(seen, dropped, oversize, measured_loss, requested_loss)``: ``seen`` counts
        packets eligible for loss (IPv4 > 200 B, or all IPv4 with ``all_sizes``), ``oversize``
        packets longer than the MTU (must stay 0: offloads are off), ``measured_loss`` =
        dropped / seen (0.0 when nothing was seen).
        """
        h = self._host(h)
        ns, table = self._loss_point(h, direction)
        r = support._ns_exec(ns, ["nft", "-j", "list", "counters", "table", "netdev", table])
        if r.returncode != 0:
            raise RuntimeError(f"reading nft counters in {ns} failed: {r.stderr.strip()}")
        c = {item["counter"]["name"]: item["counter"]["packets"]
             for item in json.loads(r.stdout)["nftables"] if "counter" in item}
        seen, dropped = c.get("seen", 0), c.get("dropped", 0)
        return dict(seen=seen, dropped=dropped, oversize=c.get("oversize", 0),
                    measured_loss=dropped / seen if seen else 0.0,
                    requested_loss=self._impair.get((h.index, direction), Impairment()).loss)

    def reset_stats(self, h: Host | int | str, direction: str = "ingress") -> None:
        """Zero the loss counters of (h, direction)."""
        h = self._host(h)
        ns, table = self._loss_point(h, direction)
        r = support._ns_exec(ns, ["nft", "reset", "counters", "table", "netdev", table])
        if r.returncode != 0:
            raise RuntimeError(f"resetting nft counters in {ns} failed: {r.stderr.strip()}")

    def delayer_stats(self, h: Host | int | str, direction: str = "ingress") -> dict | None:
        """Kernel counters of the NFQUEUE feeding the delayer of (h, direction), or None without one.

        Returns ``dict(queue=, held=, queue_dropped=, user_dropped=)``: ``held`` packets are in
        the queue now; ``queue_dropped`` overflowed the queue (maxlen) and ``user_dropped``
        the netlink socket buffer — both must stay 0, or the delayer cannot keep up.
        Read from /proc/net/netfilter/nfnetlink_queue inside the delayer's namespace.
        """
        h = self._host(h)
        if (h.index, direction) not in self._delayers:
            return None
        ns, queue = self._delay_point(h, direction)[:2]
        r = support._ns_exec(ns, ["cat", "/proc/net/netfilter/nfnetlink_queue"])
        for line in r.stdout.splitlines():
            f = line.split()
            if len(f) >= 7 and int(f[0]) == queue:
                return dict(queue=queue, held=int(f[2]), queue_dropped=int(f[5]), user_dropped=int(f[6]))
        raise RuntimeError(f"queue {queue} not found in {ns}'s nfnetlink_queue: is the delayer running?")

    # ------------------------------------------------------------------ processes
    def _argv(self, h: Host | int | str, argv: Sequence[str]) -> list[str]:
        if isinstance(argv, str):
            raise TypeError("argv must be a list of strings, not a shell string")
        return ["ip", "netns", "exec", self._host(h).netns, *argv]

    def run(self, h: Host | int | str, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` inside host ``h``'s namespace (``subprocess.run`` keyword arguments apply)."""
        return subprocess.run(self._argv(h, argv), **kwargs)

    def popen(self, h: Host | int | str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside host ``h``'s namespace; it is killed at lab exit if still running."""
        kwargs.setdefault("start_new_session", True)
        p = subprocess.Popen(self._argv(h, argv), **kwargs)
        self._procs.append(p)
        return p

    def describe(self) -> dict:
        """A JSON-able description of the lab (used by ``ltp-lab up``)."""
        return dict(prefix=self.prefix, switch_ns=self.switch_ns, mtu=self.mtu, racks=self.racks,
                    backend=self.backend, gro=self.gro,
                    hosts=[dataclasses.asdict(h) for h in self.hosts])


UPLINK_QUEUE_BASE = 1000  # NFQUEUE numbers of uplink delayers (host egress delayers use 1 .. n_hosts)
INGRESS_QUEUE_BASE = 2000  # NFQUEUE numbers of host ingress delayers (2000 + host index)


class RateRedrawer:
    """Background thread that redraws host rates every ``period_s`` (see :meth:`Lab.redraw_rates`)."""

    def __init__(self, lab: Lab, hosts: list, period_s: float, draw, seed: int, direction: str):
        import random

        self.lab, self.hosts, self.period_s, self.draw, self.direction = lab, hosts, period_s, draw, direction
        self.rng = random.Random(seed)
        self.history: list[tuple[float, dict]] = []  # (monotonic time, {host name: bit/s})
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lab-rate-redraw", daemon=True)

    def start(self) -> None:
        self._apply()
        self._thread.start()

    def _apply(self) -> None:
        import time

        rates = {}
        for h in self.hosts:
            bps = float(self.draw(self.rng))
            if bps <= 0:
                raise ValueError(f"rate draw returned {bps} bit/s; draws must be positive")
            old = self.lab.impairment(h, self.direction)
            self.lab.impair(h, self.direction, loss=old.loss, rate_bps=bps, queue_bytes=old.queue_bytes,
                            delay_s=old.delay_s, jitter_s=old.jitter_s, all_sizes=old.all_sizes)
            rates[h.name] = bps
        self.history.append((time.monotonic(), rates))

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self._apply()
            except Exception as exc:  # the lab closed under us, or a tc call failed: record and stop
                self.errors.append(f"{type(exc).__name__}: {exc}")
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)


def _counter_table(table: str, device: str, hook: str = "ingress") -> str:
    return (f"table netdev {table} {{\n"
            f"  counter seen {{}}\n  counter dropped {{}}\n  counter oversize {{}}\n"
            f'  chain lossy {{ type filter hook {hook} device "{device}" priority 0; policy accept; }}\n'
            f"}}\n")


def _terminate(p: subprocess.Popen, grace_s: float = 1.0) -> None:
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        p.terminate()
    try:
        p.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=5)


def _raise_system_exit(signum, frame):  # noqa: ARG001
    raise SystemExit(128 + signum)
