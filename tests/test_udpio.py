"""Loopback tests of ``ltp_ext._udpio`` (compiled) and its twin ``ltp_ext._udpio_py``.

Every test runs against both implementations. The compiled parameter is
skipped only when the extension is missing *and* ``LTP_NO_EXTENSIONS`` is set;
otherwise a missing extension fails the run.
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import socket
import struct
import sys
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ext_helpers import implementation
from net_helpers import ipv6_loopback, run_in_fresh_netns

SO_NO_CHECK = 11      # <asm-generic/socket.h>; makes UDP_SEGMENT sends fail with EINVAL
SO_RCVBUFFORCE = 33   # root may exceed net.core.rmem_max
RCVBUF = 16 << 20     # bytes


def _load(name: str):
    return implementation("udpio", name)


@pytest.fixture(params=["compiled", "twin"])
def mod(request):
    return _load(request.param)


FAMILIES = [pytest.param((socket.AF_INET, "127.0.0.1"), id="ipv4"),
            pytest.param((socket.AF_INET6, "::1"), id="ipv6",
                         marks=pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback"))]


@pytest.fixture(params=FAMILIES)
def fam(request):
    return request.param


class Sockets:
    """Closes every socket it made."""

    def __init__(self):
        self.all: list[socket.socket] = []

    def make(self, family=socket.AF_INET, host="127.0.0.1") -> socket.socket:
        s = socket.socket(family, socket.SOCK_DGRAM)
        s.bind((host, 0))
        try:
            s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RCVBUF)
        except OSError:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
        self.all.append(s)
        return s

    def close(self):
        for s in self.all:
            s.close()


@pytest.fixture
def socks():
    s = Sockets()
    yield s
    s.close()


def drain(io, want: int, timeout: float = 2.0) -> list[tuple[bytes, tuple]]:
    """Receive until ``want`` datagrams arrived (or timeout); return [(payload, source)]."""
    got: list[tuple[bytes, tuple]] = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        n = io.recv_batch()
        if n == 0:
            time.sleep(0.001)
            continue
        buf, offs, lens = io.buffer, io.offsets, io.lengths
        assert len(offs) == len(lens) == n == len(io)
        assert offs.dtype == np.int64 and lens.dtype == np.int64
        for i in range(n):
            got.append((bytes(buf[offs[i]:offs[i] + lens[i]]), io.addr(i)))
    return got


def payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_single_datagram_roundtrip(mod, socks, fam):
    family, host = fam
    a, b = socks.make(family, host), socks.make(family, host)
    rx, tx = mod.UdpIO(a), mod.UdpIO(b)
    assert rx.family == family
    assert tx.send(a.getsockname(), b"hello, ltp", 1472) == 10
    got = drain(rx, 1)
    assert got == [(b"hello, ltp", b.getsockname())]
    assert rx.runs() == [(b.getsockname(), 0, 1)]
    assert tx.stats["datagrams_out"] == 1 and rx.stats["datagrams_in"] == 1
    assert rx.recv_batch() == 0


@pytest.mark.parametrize("gso", [True, False], ids=["gso", "nogso"])
@pytest.mark.parametrize("gro", [True, False], ids=["gro", "nogro"])
def test_gso_batch_with_short_last_segment(mod, socks, fam, gso, gro):
    family, host = fam
    a, b = socks.make(family, host), socks.make(family, host)
    rx, tx = mod.UdpIO(a, gro=gro), mod.UdpIO(b, gso=gso)
    assert rx.gro_enabled is gro
    data = payload(10 * 1000 + 333)
    assert tx.send(a.getsockname(), data, 1000) == len(data)
    got = drain(rx, 11)
    assert [len(p) for p, _ in got] == [1000] * 10 + [333]
    assert b"".join(p for p, _ in got) == data
    assert all(src == b.getsockname() for _, src in got)
    st_ = tx.stats
    assert st_["datagrams_out"] == 11 and st_["errors"] == {}
    if gso and tx.gso_enabled:
        assert st_["syscalls"] == 1      # one UDP_SEGMENT super-datagram
    if gro and gso and tx.gso_enabled:
        # the coalesced run arrives in one slot and is split back
        assert rx.stats["syscalls"] <= 2
        assert rx.runs() == [(b.getsockname(), 0, 11)]
        assert rx.stats["slots_in"] == 1 and rx.stats["datagrams_in"] == 11
    elif not gro:
        assert rx.stats["slots_in"] == rx.stats["datagrams_in"] == 11


def test_large_send_is_cut_into_gso_chunks(mod, socks, fam):
    family, host = fam
    a, b = socks.make(family, host), socks.make(family, host)
    rx, tx = mod.UdpIO(a, batch=16), mod.UdpIO(b)
    seg = 1400
    data = payload(200 * seg - 7, seed=1)
    assert tx.send(a.getsockname(), np.frombuffer(data, dtype=np.uint8), seg) == len(data)
    got = drain(rx, 200)
    assert len(got) == 200
    assert b"".join(p for p, _ in got) == data
    if tx.gso_enabled:
        per = min(mod.GSO_MAX_SEGMENTS, mod.GSO_MAX_BYTES // seg)   # 46 segments per super-datagram
        assert tx.stats["syscalls"] == (1 if mod.__name__ == "ltp_ext._udpio" else -(-200 // per))


def test_coalesced_run_longer_than_the_preallocated_arrays(mod, socks):
    # newer kernels accept up to 128 segments per UDP_SEGMENT send; with GRO on loopback they
    # arrive in one slot, more datagrams than batch * 64 preallocated entries
    a, b = socks.make(), socks.make()
    rx = mod.UdpIO(a, batch=1)
    if not rx.gro_enabled:
        pytest.skip("kernel has no UDP_GRO")
    data = payload(1000, 5)
    try:
        b.sendmsg([data], [(17, 103, struct.pack("@H", 10))], 0, a.getsockname())   # SOL_UDP, UDP_SEGMENT
    except OSError as exc:
        pytest.skip(f"kernel refuses 100 segments per GSO send: {exc}")
    time.sleep(0.02)
    assert rx.recv_batch() == 100
    assert rx.lengths.tolist() == [10] * 100
    assert b"".join(bytes(rx.buffer[o:o + n]) for o, n in zip(rx.offsets, rx.lengths)) == data
    assert rx.runs() == [(b.getsockname(), 0, 100)]


def test_gro_split_survives_other_control_messages(mod, socks):
    # timestamps and pktinfo share the control buffer with the UDP_GRO message
    a, b = socks.make(), socks.make()
    for level, opt in ((socket.SOL_SOCKET, 35),      # SO_TIMESTAMPNS: 32 bytes, before UDP_GRO
                       (socket.SOL_SOCKET, 40),      # SO_RXQ_OVFL: 24 bytes, before UDP_GRO
                       (socket.IPPROTO_IP, 8),       # IP_PKTINFO
                       (socket.IPPROTO_IP, 12),      # IP_RECVTTL
                       (socket.IPPROTO_IP, 13)):     # IP_RECVTOS
        a.setsockopt(level, opt, 1)
    rx, tx = mod.UdpIO(a), mod.UdpIO(b)
    data = payload(6000, 6)
    assert tx.send(a.getsockname(), data, 1000) == 6000
    got = drain(rx, 6)
    assert [len(p) for p, _ in got] == [1000] * 6 and b"".join(p for p, _ in got) == data
    assert rx.stats["errors"] == {}


def test_multidimensional_buffer_is_sent_as_bytes(mod, socks):
    a, b = socks.make(), socks.make()
    rx, tx = mod.UdpIO(a), mod.UdpIO(b)
    arr = np.arange(600, dtype=np.float32).reshape(20, 30)
    assert tx.send(a.getsockname(), arr, 1000) == arr.nbytes
    got = drain(rx, 3)
    assert b"".join(p for p, _ in got) == arr.tobytes()


def test_runs_of_mixed_sources(mod, socks):
    a = socks.make()
    s1, s2, s3 = socks.make(), socks.make(), socks.make()
    rx = mod.UdpIO(a)
    t1, t2, t3 = mod.UdpIO(s1), mod.UdpIO(s2), mod.UdpIO(s3)
    dst = a.getsockname()
    t1.send(dst, b"a0", 100)
    t1.send(dst, b"a1", 100)
    t2.send(dst, b"b0", 100)
    t1.send(dst, b"a2", 100)
    t3.send(dst, b"c0c1", 2)          # two datagrams, GSO-coalesced when possible
    t1.send(dst, b"a3", 100)
    got = drain(rx, 7)
    assert [p for p, _ in got] == [b"a0", b"a1", b"b0", b"a2", b"c0", b"c1", b"a3"]
    A, B, C = s1.getsockname(), s2.getsockname(), s3.getsockname()
    assert [src for _, src in got] == [A, A, B, A, C, C, A]
    assert rx.runs() == [(A, 0, 2), (B, 2, 3), (A, 3, 4), (C, 4, 6), (A, 6, 7)]


def test_both_implementations_see_the_same_batch(socks):
    comp, twin = _load("compiled"), importlib.import_module("ltp_ext._udpio_py")
    ra, rb, src1, src2 = socks.make(), socks.make(), socks.make(), socks.make()
    ioa, iob = comp.UdpIO(ra, batch=16), twin.UdpIO(rb, batch=16)
    t1, t2 = comp.UdpIO(src1), comp.UdpIO(src2)
    for dst in (ra.getsockname(), rb.getsockname()):
        t1.send(dst, payload(5000, 2), 700)
        t2.send(dst, b"x" * 10, 3)
        t1.send(dst, b"tail", 700)
    time.sleep(0.05)
    assert ioa.recv_batch() == iob.recv_batch() == 8 + 4 + 1
    assert np.array_equal(ioa.offsets, iob.offsets) and np.array_equal(ioa.lengths, iob.lengths)
    assert ioa.runs() == iob.runs()
    for i in range(len(ioa)):
        o, n = ioa.offsets[i], ioa.lengths[i]
        assert ioa.buffer[o:o + n] == iob.buffer[o:o + n]
        assert ioa.addr(i) == iob.addr(i)


def test_empty_socket_returns_zero(mod, socks):
    io = mod.UdpIO(socks.make())
    assert io.recv_batch() == 0
    assert len(io) == 0 and len(io.offsets) == 0 and io.runs() == []
    s = io.stats
    assert s["eagain"] == 1 and s["datagrams_in"] == 0 and s["syscalls"] == 1


def test_icmp_errors_are_counted_not_raised(mod, socks):
    dead = socks.make()
    port = dead.getsockname()
    dead.close()                      # nothing listens there any more: ICMP port unreachable
    s = socks.make()
    s.connect(port)                   # a connected UDP socket gets ICMP errors as socket errors
    io = mod.UdpIO(s)
    # (loops: the host-wide ICMP rate limit may swallow an ICMP message now and then)
    for _ in range(50):
        assert io.send(None, b"ping", 100) == 4
        time.sleep(0.01)
        assert io.recv_batch() == 0   # recvmmsg fails with ECONNREFUSED: counted, swallowed
        if io.stats["errors"]:
            break
    assert io.stats["errors"] == {"ECONNREFUSED": 1}
    # a pending error fails the next send once; the datagram is retried and goes out
    out_before = io.stats["datagrams_out"]
    for _ in range(50):
        before = io.stats["errors"]["ECONNREFUSED"]
        assert io.send(port, b"ping", 100) == 4
        time.sleep(0.01)
        assert io.send_many([(None, b"ping", 100), (port, b"pong" * 10, 10)]) == 2
        if io.stats["errors"]["ECONNREFUSED"] > before:
            break
    st_ = io.stats
    assert st_["errors"]["ECONNREFUSED"] > before and set(st_["errors"]) == {"ECONNREFUSED"}
    assert st_["datagrams_out"] > out_before


_UNREACHABLE_SCRIPT = """
import importlib, json, socket, sys
mod = importlib.import_module(sys.argv[1])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
io = mod.UdpIO(s)
sent = io.send(("10.1.2.3", 9), b"abcdef", 4)
many = io.send_many([(("10.1.2.3", 9), b"xy", 1)] * 3)
print(json.dumps({"sent": sent, "many": many, "stats": io.stats, "gso": io.gso_enabled}))
"""


@pytest.mark.netns
def test_unreachable_destination_is_dropped_like_a_loss(mod):
    # In a fresh network namespace (no routes, lo down) every sendmsg fails with
    # ENETUNREACH: each message is counted, retried once, then dropped like a loss.
    proc = run_in_fresh_netns(_UNREACHABLE_SCRIPT, mod.__name__)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["sent"] == 6 and out["many"] == 3
    errors = out["stats"]["errors"]
    messages = (1 + 3) if out["gso"] else (2 + 3 * 2)    # GSO: one message per item
    assert errors == {"ENETUNREACH": 2 * messages}        # every message fails twice
    assert out["stats"]["datagrams_out"] == 0


_EAGAIN_SCRIPT = """
import importlib, json, socket, subprocess, sys
# lo throttled to 1 Mbit/s: queued datagrams hold the sender's tiny send buffer, so sends hit EAGAIN
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1mbit", "burst", "1600",
                "limit", "10000000"], check=True)
mod = importlib.import_module(sys.argv[1])
r = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
r.bind(("127.0.0.1", 0))
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
io = mod.UdpIO(s, gso=sys.argv[2] == "1")
sent = [io.send(r.getsockname(), b"x" * 100000, 1000) for _ in range(3)]
many = io.send_many([(r.getsockname(), b"y" * 10, 10)] * 5)
print(json.dumps({"sent": sent, "many": many, "stats": io.stats}))
"""


@pytest.mark.netns
@pytest.mark.parametrize("gso", ["1", "0"], ids=["gso", "nogso"])
def test_send_stops_early_on_eagain(mod, gso):
    proc = run_in_fresh_netns(_EAGAIN_SCRIPT, mod.__name__, gso, tools=("unshare", "tc"),
                              setup_errors=("unshare", "RTNETLINK"))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    first = out["sent"][0]
    assert 0 < first < 100000 and first % 1000 == 0       # whole segments only
    assert out["sent"][1:] == [0, 0] and out["many"] == 0
    st_ = out["stats"]
    assert st_["datagrams_out"] == first // 1000
    assert st_["eagain"] == 4 and st_["errors"] == {}


def test_gso_refused_by_kernel_falls_back(mod, socks):
    a, b = socks.make(), socks.make()
    b.setsockopt(socket.SOL_SOCKET, SO_NO_CHECK, 1)   # UDP_SEGMENT needs checksums: EINVAL
    rx, tx = mod.UdpIO(a), mod.UdpIO(b)
    if not tx.gso_enabled:
        pytest.skip("kernel has no UDP_SEGMENT")
    data = payload(5000, 3)
    assert tx.send(a.getsockname(), data, 1000) == len(data)
    got = drain(rx, 5)
    assert b"".join(p for p, _ in got) == data
    assert tx.stats["errors"] == {"EINVAL": 1}


def test_oversized_datagram_is_dropped_and_counted(mod, socks):
    a, b = socks.make(), socks.make()
    rx = mod.UdpIO(a, max_datagram=100, gro=False)
    b.sendto(b"z" * 200, a.getsockname())
    b.sendto(b"ok", a.getsockname())
    time.sleep(0.05)
    assert rx.recv_batch() == 1
    assert bytes(rx.buffer[rx.offsets[0]:rx.offsets[0] + rx.lengths[0]]) == b"ok"
    assert rx.stats["errors"] == {"EMSGSIZE": 1}


def test_send_many_counts_items(mod, socks):
    a, b = socks.make(), socks.make()
    rx, tx = mod.UdpIO(a), mod.UdpIO(b)
    dst = a.getsockname()
    items = [(dst, b"one", 10), (dst, b"", 10), (dst, payload(2500, 4), 1000), (dst, bytearray(b"end"), 1)]
    assert tx.send_many(items) == 4
    assert tx.send_many([]) == 0
    got = drain(rx, 1 + 3 + 3)
    assert [p for p, _ in got] == [b"one", *[payload(2500, 4)[i:i + 1000] for i in (0, 1000, 2000)], b"e", b"n", b"d"]


def test_bad_arguments_raise(mod, socks):
    a, b = socks.make(), socks.make()
    tx = mod.UdpIO(b)
    dst = a.getsockname()
    for seg in (0, -1, 65508, 2 ** 70):
        with pytest.raises(ValueError, match="segment_size"):
            tx.send(dst, b"x", seg)
    with pytest.raises(TypeError):
        tx.send(dst, b"x", 1.5)
    with pytest.raises(ValueError, match="C-contiguous"):
        tx.send(dst, np.arange(100, dtype=np.uint8)[::2], 10)
    with pytest.raises(ValueError, match="C-contiguous"):
        tx.send(dst, np.zeros((10, 10), dtype=np.uint8).T, 10)
    with pytest.raises(TypeError):
        tx.send(dst, 12345, 10)
    with pytest.raises(TypeError):
        tx.send(("127.0.0.1",), b"x", 10)
    with pytest.raises(TypeError):
        tx.send(["127.0.0.1", 1], b"x", 10)
    with pytest.raises(OverflowError):
        tx.send(("127.0.0.1", 70000), b"x", 10)
    with pytest.raises(OSError):
        tx.send(("no-such-host.invalid", 1), b"x", 10)
    with pytest.raises(TypeError):
        tx.send_many([(dst, b"x")])
    # send_many validates every item before sending anything
    rx = mod.UdpIO(a)
    with pytest.raises(ValueError):
        tx.send_many([(dst, b"first", 10), (dst, b"second", 0)])
    time.sleep(0.02)
    assert rx.recv_batch() == 0
    with pytest.raises(IndexError):
        rx.addr(0)
    assert tx.stats["datagrams_out"] == 0
    for kw in ({"batch": 0}, {"batch": 1025}, {"max_datagram": 0}, {"max_datagram": 65536}):
        with pytest.raises(ValueError):
            mod.UdpIO(socks.make(), **kw)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
        with pytest.raises(ValueError, match="SOCK_DGRAM"):
            mod.UdpIO(tcp)
    with pytest.raises(TypeError):
        mod.UdpIO(object())


def test_closed_socket_raises_oserror(mod, socks):
    s = socks.make()
    io = mod.UdpIO(s)
    s.close()
    with pytest.raises(OSError, match="closed") as ei:
        io.recv_batch()
    assert ei.value.errno == errno.EBADF
    with pytest.raises(OSError, match="closed"):
        io.send(("127.0.0.1", 9), b"x", 10)
    with pytest.raises(OSError, match="closed"):
        mod.UdpIO(s)


@pytest.fixture(scope="module")
def hyp_sockets():
    s = Sockets()
    yield s
    s.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), gso=st.booleans(), gro=st.booleans())
def test_random_segment_sizes_roundtrip(mod, hyp_sockets, data, gso, gro):
    seg = data.draw(st.integers(1, 9000), label="segment_size")
    length = data.draw(st.integers(0, min(40000, seg * 300)), label="length")
    raw = data.draw(st.binary(min_size=min(length, 64), max_size=min(length, 64)), label="prefix")
    msg = (raw + payload(length, seg))[:length]
    a, b = hyp_sockets.make(), hyp_sockets.make()
    try:
        rx, tx = mod.UdpIO(a, gro=gro, max_datagram=65535), mod.UdpIO(b, gso=gso)
        assert tx.send(a.getsockname(), msg, seg) == length
        nseg = -(-length // seg)
        got = drain(rx, nseg)
        assert len(got) == nseg
        assert [len(p) for p, _ in got] == [min(seg, length - i) for i in range(0, length, seg)]
        assert b"".join(p for p, _ in got) == msg
        assert tx.stats["datagrams_out"] == nseg and tx.stats["errors"] == {}
    finally:
        a.close()
        b.close()


def test_recv_errors_reports_icmp_port_unreachable_with_the_peer(mod, socks, fam):
    family, host = fam
    s = socks.make(family, host)
    io = mod.UdpIO(s)
    assert io.recverr_enabled and io.recv_errors() == []
    gone = socks.make(family, host)
    dead = gone.getsockname()
    gone.close()
    io.send(dead, b"x" * 40, 40)
    deadline = time.monotonic() + 2.0
    reports = []
    while not reports and time.monotonic() < deadline:
        time.sleep(0.005)
        reports = io.recv_errors()
    assert len(reports) == 1
    addr, err, origin, icmp_type, _code = reports[0]
    assert addr[:2] == dead[:2] and err == errno.ECONNREFUSED
    assert (origin, icmp_type) in ((2, 3), (3, 1))  # ICMP dest unreachable / ICMPv6 dest unreachable
    assert io.recv_errors() == []  # drained
    # the socket still works after the report
    peer = socks.make(family, host)
    io.send(peer.getsockname(), b"hello", 5)
    assert peer.recv(16) == b"hello"


def test_recverr_can_be_turned_off(mod, socks):
    io = mod.UdpIO(socks.make(), recverr=False)
    assert not io.recverr_enabled and io.recv_errors() == []


def test_the_sockets_own_drops_are_reported_with_the_datagrams_read(mod, socks):
    """SO_RXQ_OVFL: a receiver whose buffer overflowed learns how many datagrams its socket dropped (the count
    ``EndpointStats.socket_drops``); 0 while none was dropped."""
    rx, tx = socks.make(), socks.make()
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the kernel's minimum: a few datagrams fit
    io = mod.UdpIO(rx)
    assert io.drops_enabled and io.socket_drops == 0
    dst = rx.getsockname()
    tx.sendto(b"x" * 1000, dst)
    assert drain(io, 1) and io.socket_drops == 0
    for _ in range(200):
        tx.sendto(b"y" * 1000, dst)
    got = drain(io, 200, timeout=0.5)
    assert 0 < len(got) < 200
    # the kernel stamps the count on a datagram when it queues it: the next one after the drops tells
    tx.sendto(b"z" * 10, dst)
    assert drain(io, 1)
    assert io.socket_drops == 200 - len(got) and io.stats["socket_drops"] == io.socket_drops


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_receive_buffers_commit_memory_only_where_datagrams_land(mod, socks):
    """An endpoint opens up to 64 peer sockets, each with a ``UdpIO`` whose GRO receive buffer is 64 slots of
    64 kB: the buffer must not be committed until datagrams are written into it (the twin zero-filled a bytearray,
    4 MB per socket: 32 of them committed 128 MB; the compiled module's per-socket arrays commit about 0.3 MB), and
    datagrams written into the uncommitted buffer read back whole."""
    n = 32
    probe = mod.UdpIO(socks.make(), gro=True)
    if not probe.gro_enabled:
        pytest.skip("UDP_GRO refused by this kernel: the receive slots are datagram-sized")
    size = len(probe.buffer)
    assert size >= 64 * 65536 // 2  # the case this test is about: a large, mostly unused buffer
    before = _rss_bytes()
    sockets = [socks.make() for _ in range(n)]
    ios = [mod.UdpIO(s, gro=True) for s in sockets]
    grown = _rss_bytes() - before
    assert grown < n * size // 4, f"{n} receive buffers of {size} bytes committed {grown} bytes"
    tx = mod.UdpIO(socks.make())
    data = payload(1000)
    for _ in range(64):
        assert tx.send(sockets[0].getsockname(), data, 1000) == len(data)
    assert [p for p, _ in drain(ios[0], 64)] == [data] * 64
