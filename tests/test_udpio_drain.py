"""``UdpIO.drain``: a bulk receive fed from the socket straight into its ``RecvWindow``.

Loopback sockets; every test runs with the compiled ``UdpIO`` and its twin, and with the compiled
``RecvWindow`` and its twin (the compiled drain takes the twin window through its generic path).
The drain must consume exactly what the per-batch path (``recv_batch`` + ``RecvWindow.ingest``) would,
and leave the rest of a batch readable for that path.
"""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from ext_helpers import implementation
from hypothesis import strategies as st

from ltp_ext._wire_py import T_ACK, T_DATA, pack_header

SO_RCVBUFFORCE = 33
FID, TOKEN, SEG = 7, 0xC0FFEE01, 100


_load = implementation


@pytest.fixture(params=["compiled", "twin"])
def io_mod(request):
    return _load("udpio", request.param)


@pytest.fixture(params=["compiled", "twin"])
def dp(request):
    return _load("datapath", request.param)


class Net:
    """Loopback sockets, closed at the end."""

    def __init__(self):
        self.all: list[socket.socket] = []

    def sock(self) -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", 0))
        try:
            s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)
        except OSError:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.all.append(s)
        return s


@pytest.fixture
def net():
    n = Net()
    yield n
    for s in n.all:
        s.close()


def message(nseg: int, last: int = SEG) -> bytes:
    return np.random.default_rng(nseg).integers(0, 256, (nseg - 1) * SEG + last, dtype=np.uint8).tobytes()


def data(msg: bytes, seq: int, fid: int = FID, token: int = TOKEN, attempt: int = 1) -> bytes:
    return pack_header(T_DATA, 0, fid, token, seq << 8 | attempt, 0) + msg[seq * SEG:(seq + 1) * SEG]


def window(dp, msg: bytes, ack_capacity: int = 4096):
    return dp.RecvWindow(bytearray(len(msg)), len(msg), SEG, FID, TOKEN, None, ack_capacity)


def settle(rx: socket.socket, want: int, timeout: float = 2.0) -> None:
    """Wait until ``want`` datagrams are queued on ``rx`` (loopback delivers at once; be sure)."""
    deadline = time.monotonic() + timeout
    import fcntl
    import termios
    while time.monotonic() < deadline:
        buf = bytearray(4)
        fcntl.ioctl(rx.fileno(), termios.FIONREAD, buf)  # the first datagram's size only: poll briefly
        if int.from_bytes(buf, "little") > 0:
            break
        time.sleep(0.001)
    time.sleep(0.01 + want * 2e-6)


def queued(net, io_mod, dp, msg: bytes, nseg: int, *, batch: int = 64, ack_capacity: int = 4096):
    """Segments 0..nseg-1 of ``msg`` queued on a fresh receiving socket from one sender: ``(io, window, sender)``."""
    rx, tx = net.sock(), net.sock()
    for seq in range(nseg):
        tx.sendto(data(msg, seq), rx.getsockname())
    settle(rx, nseg)
    return io_mod.UdpIO(rx, batch=batch), window(dp, msg, ack_capacity), tx.getsockname()


def test_a_whole_message_is_drained_into_the_window(io_mod, dp, net):
    msg = message(300, last=37)
    io, w, src = queued(net, io_mod, dp, msg, 300)
    batches, read, used, nbytes, resume = io.drain(w, src, 32)
    assert (read, used) == (300, 300)
    assert nbytes == 300 * 16 + len(msg)
    assert resume == len(io)
    assert w.received == w.seg_count == 300 and bytes(w.dest) == msg
    assert batches == 5  # 64 * 4 + 44: the fifth completes the window and ends the drain
    assert w.n_acks == 300 and sorted(int(e) >> 8 for e in w.take_acks()) == list(range(300))
    assert io.stats["datagrams_in"] == 300


def test_a_foreign_datagram_ends_the_drain_and_stays_readable(io_mod, dp, net):
    rx, tx, other = net.sock(), net.sock(), net.sock()
    msg = message(40)
    dst = rx.getsockname()
    for seq in range(10):
        tx.sendto(data(msg, seq), dst)
    other.sendto(data(msg, 10), dst)             # right flow id and token, wrong source
    tx.sendto(pack_header(T_ACK, 0, FID, TOKEN, 0, 0), dst)  # right source, not DATA
    for seq in range(11, 15):
        tx.sendto(data(msg, seq), dst)
    settle(rx, 16)
    io = io_mod.UdpIO(rx, batch=64)
    w = window(dp, msg)
    batches, read, used, nbytes, resume = io.drain(w, tx.getsockname(), 32)
    assert (batches, read, used, resume) == (1, 16, 10, 10)
    assert nbytes == 10 * (16 + SEG)
    A, B = tx.getsockname(), other.getsockname()
    assert io.runs(resume) == [(B, 10, 11), (A, 11, 16)]
    assert io.runs() == [(A, 0, 10), (B, 10, 11), (A, 11, 16)]
    # the caller's own path takes it from there: the ACK is not DATA, then four segments of the flow
    assert w.ingest(io.buffer, io.offsets, io.lengths, 11, 16) == 11
    assert w.ingest(io.buffer, io.offsets, io.lengths, 12, 16) == 16
    assert w.received == 14 and w.dest[:10 * SEG] == msg[:10 * SEG]


def test_another_flows_data_from_the_same_source_ends_the_drain(io_mod, dp, net):
    rx, tx = net.sock(), net.sock()
    msg = message(20)
    dst = rx.getsockname()
    tx.sendto(data(msg, 0), dst)
    tx.sendto(data(msg, 1, fid=FID + 1), dst)
    tx.sendto(data(msg, 2, token=TOKEN ^ 1), dst)
    settle(rx, 3)
    io = io_mod.UdpIO(rx, batch=8)
    w = window(dp, msg)
    assert io.drain(w, tx.getsockname(), 4) == (1, 3, 1, 16 + SEG, 1)
    assert w.received == 1


def test_a_full_ack_buffer_ends_the_drain_at_the_datagram_it_could_not_take(io_mod, dp, net):
    msg = message(30)
    io, w, src = queued(net, io_mod, dp, msg, 30, ack_capacity=8)
    batches, read, used, _, resume = io.drain(w, src, 32)
    assert (batches, read, used, resume) == (1, 30, 8, 8)
    assert w.n_acks == 8 and w.received == 8
    w.take_acks()  # what the engine does before it ingests the rest
    assert w.ingest(io.buffer, io.offsets, io.lengths, 8, 30) == 16


def test_duplicates_and_bad_datagrams_are_consumed_and_counted(io_mod, dp, net):
    rx, tx = net.sock(), net.sock()
    msg = message(10)
    dst = rx.getsockname()
    for seq in (0, 1, 1, 2):
        tx.sendto(data(msg, seq), dst)
    tx.sendto(pack_header(T_DATA, 0, FID, TOKEN, 99 << 8 | 1, 0) + bytes(SEG), dst)   # beyond the message
    tx.sendto(pack_header(T_DATA, 0, FID, TOKEN, 3 << 8 | 1, 0) + bytes(SEG - 1), dst)  # short payload
    settle(rx, 6)
    io = io_mod.UdpIO(rx, batch=64)
    w = window(dp, msg)
    batches, read, used, nbytes, resume = io.drain(w, tx.getsockname(), 2)
    assert (read, used) == (6, 6)
    assert resume == len(io) == 0  # the last batch is the empty read that ended the drain
    assert (w.received, w.duplicates, w.bad_seq, w.bad_length) == (3, 1, 1, 1)
    assert nbytes == 5 * (16 + SEG) + 16 + SEG - 1
    assert batches == 2  # the first batch was short but min_datagrams is 0; the second read found nothing


def test_a_short_batch_ends_the_drain_with_min_datagrams(io_mod, dp, net):
    io, w, src = queued(net, io_mod, dp, message(10), 3)
    assert io.drain(w, src, 32, 8) == (1, 3, 3, 3 * (16 + SEG), 3)


def test_max_batches_bounds_the_receives(io_mod, dp, net):
    io, w, src = queued(net, io_mod, dp, message(100), 100, batch=16)
    assert io.drain(w, src, 3) == (3, 48, 48, 48 * (16 + SEG), 16)
    assert w.received == 48
    assert io.drain(w, src, 100)[:3] == (4, 52, 52)  # 16 + 16 + 16 + 4: complete
    assert w.received == 100


def test_an_empty_socket(io_mod, dp, net):
    rx, tx = net.sock(), net.sock()
    io = io_mod.UdpIO(rx)
    w = window(dp, message(3))
    assert io.drain(w, tx.getsockname(), 5) == (1, 0, 0, 0, 0)
    assert len(io) == 0 and io.runs() == [] and io.runs(0) == []


def test_misuse_raises_a_clear_error(io_mod, dp, net):
    rx, tx = net.sock(), net.sock()
    io = io_mod.UdpIO(rx)
    w = window(dp, message(3))
    with pytest.raises(ValueError, match="max_batches"):
        io.drain(w, tx.getsockname(), 0)
    with pytest.raises(TypeError, match="RecvWindow"):
        io.drain(object(), tx.getsockname(), 1)
    with pytest.raises(ValueError, match="start"):
        io.runs(-1)
    rx.close()
    with pytest.raises(OSError):
        io.drain(w, tx.getsockname(), 1)


def window_of(dp, msg: bytes, fid: int, token: int = TOKEN):
    return dp.RecvWindow(bytearray(len(msg)), len(msg), SEG, fid, token, None, 4096)


def test_drain_flows_feeds_interleaved_flows_of_several_sources_and_one_source(io_mod, dp, net):
    """A gather: flows from two senders and a second flow of the first sender, interleaved datagram by datagram,
    each fed into its own window; the counts come back per window, in the order given."""
    rx, a, b = net.sock(), net.sock(), net.sock()
    msgs = [message(30, last=7), message(20), message(25, last=3)]
    dst = rx.getsockname()
    plan = [(a, 0, FID), (b, 1, FID), (a, 2, FID + 1)]  # (sender, message, flow id)
    nsegs = [-(-len(msgs[m]) // SEG) for _s, m, _f in plan]
    order = [(k, seq) for seq in range(max(nsegs)) for k in range(3) if seq < nsegs[k]]
    for k, seq in order:
        sock, m, fid = plan[k]
        sock.sendto(data(msgs[m], seq, fid=fid), dst)
    settle(rx, len(order))
    io = io_mod.UdpIO(rx, batch=16)
    ws = [window_of(dp, msgs[m], fid) for _s, m, fid in plan]
    srcs = [sock.getsockname() for sock, _m, _f in plan]
    consumed = [0, 0, 0]
    nbytes = [0, 0, 0]
    while True:
        batches, read, used, nb, resume = io.drain_flows(ws, srcs, 64)
        assert isinstance(used, list) and len(used) == len(nb) == 3
        consumed = [x + y for x, y in zip(consumed, used)]
        nbytes = [x + y for x, y in zip(nbytes, nb)]
        assert resume == len(io)  # every datagram belongs to a listed flow
        if read == 0:
            break
    for w, m, used, nb in zip(ws, msgs, consumed, nbytes):
        assert bytes(w.dest) == m and w.received == w.seg_count == used
        assert nb == used * 16 + len(m)


def test_drain_flows_stops_at_an_unlisted_source_and_at_a_completed_window(io_mod, dp, net):
    rx, a, b, c = net.sock(), net.sock(), net.sock(), net.sock()
    m1, m2 = message(4), message(40)
    dst = rx.getsockname()
    for seq in range(4):  # a's whole message, then b's first segments: the batch that completes a's window ends it
        a.sendto(data(m1, seq), dst)
        b.sendto(data(m2, seq), dst)
    c.sendto(data(m2, 4), dst)  # right flow id and token, a source that is not listed
    b.sendto(data(m2, 5), dst)
    settle(rx, 10)
    io = io_mod.UdpIO(rx, batch=8)
    w1, w2 = window(dp, m1), window(dp, m2)
    batches, read, used, nb, resume = io.drain_flows([w1, w2], [a.getsockname(), b.getsockname()], 32)
    assert (batches, read, used, resume) == (1, 8, [4, 4], 8)  # w1 complete: the caller closes it now
    assert w1.received == w1.seg_count
    batches, read, used, nb, resume = io.drain_flows([w2], [b.getsockname()], 32)
    assert (batches, read, used, resume) == (1, 2, [0], 0)  # c's datagram is the caller's
    assert io.runs(resume) == [(c.getsockname(), 0, 1), (b.getsockname(), 1, 2)]


def test_drain_flows_misuse_raises_a_clear_error(io_mod, dp, net):
    rx, tx = net.sock(), net.sock()
    io = io_mod.UdpIO(rx)
    w = window(dp, message(3))
    with pytest.raises(ValueError, match="one source address per window"):
        io.drain_flows([w, w], [tx.getsockname()], 1)
    with pytest.raises(ValueError, match="at least one window"):
        io.drain_flows([], [], 1)
    with pytest.raises(TypeError, match="RecvWindow"):
        io.drain_flows([w, object()], [tx.getsockname()] * 2, 1)


@pytest.mark.parametrize("which", ["compiled", "twin"])
def test_drain_matches_the_per_batch_path(which, net):
    """Same datagrams, two receivers: one drains, the other reads batch by batch and ingests run by run."""
    io_mod, dp = _load("udpio", which), _load("datapath", which)
    rx1, rx2, tx, other = net.sock(), net.sock(), net.sock(), net.sock()
    msg = message(200, last=11)
    rng = np.random.default_rng(5)
    seqs = list(rng.permutation(200)) + list(rng.integers(0, 200, 30))  # reordered, then duplicates
    for dst in (rx1.getsockname(), rx2.getsockname()):
        for k, seq in enumerate(seqs):
            (other if k == 150 else tx).sendto(data(msg, int(seq)), dst)
    settle(rx1, len(seqs))
    io1, io2 = io_mod.UdpIO(rx1, batch=32), io_mod.UdpIO(rx2, batch=32)
    w1, w2 = window(dp, msg), window(dp, msg)
    src = tx.getsockname()
    used = 0
    while True:
        b, n, u, _, resume = io1.drain(w1, src, 4)
        used += u
        if resume < len(io1):  # hand the rest of the batch to the caller's path, as the endpoint does
            for addr, a, z in io1.runs(resume):
                if addr == src:
                    used += w1.ingest(io1.buffer, io1.offsets, io1.lengths, a, z) - a
        if n == 0:
            break
    while io2.recv_batch():
        for addr, a, z in io2.runs():
            if addr == src:
                w2.ingest(io2.buffer, io2.offsets, io2.lengths, a, z)
    assert used == len(seqs) - 1
    assert bytes(w1.dest) == bytes(w2.dest)
    assert np.array_equal(w1.bitmap, w2.bitmap)
    assert (w1.received, w1.duplicates) == (w2.received, w2.duplicates)
    assert np.array_equal(w1.take_acks(), w2.take_acks())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 49)), min_size=1, max_size=120),
       batch=st.integers(1, 40), max_batches=st.integers(1, 6), min_dgrams=st.integers(0, 10))
def test_compiled_and_twin_drain_agree(net, plan, batch, max_batches, min_dgrams):
    """Random interleavings of the flow's DATA (kind 0), other flows' DATA (1), other sources (2) and
    junk (3): the compiled drain and the twin return the same and leave the same window."""
    comp, twin = _load("udpio", "compiled"), _load("udpio", "twin")
    dpc, dpt = _load("datapath", "compiled"), _load("datapath", "twin")
    rxa, rxb, tx, other = net.sock(), net.sock(), net.sock(), net.sock()
    msg = message(50, last=3)
    for dst in (rxa.getsockname(), rxb.getsockname()):
        for kind, seq in plan:
            if kind == 0:
                tx.sendto(data(msg, seq), dst)
            elif kind == 1:
                tx.sendto(data(msg, seq, fid=FID + 1), dst)
            elif kind == 2:
                other.sendto(data(msg, seq), dst)
            else:
                tx.sendto(b"\x11junk", dst)
    settle(rxa, len(plan))
    ioa, iob = comp.UdpIO(rxa, batch=batch), twin.UdpIO(rxb, batch=batch)
    wa, wb = window(dpc, msg), window(dpt, msg)
    while True:
        ra = ioa.drain(wa, tx.getsockname(), max_batches, min_dgrams)
        rb = iob.drain(wb, tx.getsockname(), max_batches, min_dgrams)
        assert ra == rb
        assert ioa.runs(ra[4]) == iob.runs(rb[4])
        if ra[1] == 0:
            break
    assert bytes(wa.dest) == bytes(wb.dest)
    assert (wa.received, wa.duplicates, wa.n_acks) == (wb.received, wb.duplicates, wb.n_acks)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 29)), min_size=1, max_size=150),
       batch=st.integers(1, 40), max_batches=st.integers(1, 6), min_dgrams=st.integers(0, 10))
def test_drain_flows_agrees_with_its_twin_and_with_the_per_batch_path(net, plan, batch, max_batches, min_dgrams):
    """Random interleavings of three flows' DATA (two flows of one source, kinds 0 and 1; one of another source,
    kind 2), DATA from a source nobody listed (3) and junk (4): the compiled ``drain_flows`` and its twin return the
    same and leave the same windows, and a receiver that drains and hands each batch's rest to the per-batch path
    (as the endpoint does) ends with the windows of one that read batch by batch only."""
    comp, twin = _load("udpio", "compiled"), _load("udpio", "twin")
    dpc, dpt = _load("datapath", "compiled"), _load("datapath", "twin")
    rxa, rxb, rxc, tx, other, stranger = net.sock(), net.sock(), net.sock(), net.sock(), net.sock(), net.sock()
    msg = message(30, last=9)
    flows = [(tx, FID), (tx, FID + 1), (other, FID)]  # kind -> (source, flow id)
    for dst in (rxa.getsockname(), rxb.getsockname(), rxc.getsockname()):
        for kind, seq in plan:
            if kind < 3:
                sock, fid = flows[kind]
                sock.sendto(data(msg, seq, fid=fid), dst)
            elif kind == 3:
                stranger.sendto(data(msg, seq), dst)
            else:
                tx.sendto(b"\x11junk", dst)
    settle(rxc, len(plan))
    srcs = [sock.getsockname() for sock, _fid in flows]
    ioa, iob, ioc = comp.UdpIO(rxa, batch=batch), twin.UdpIO(rxb, batch=batch), comp.UdpIO(rxc, batch=batch)
    wa = [window_of(dpc, msg, fid) for _s, fid in flows]
    wb = [window_of(dpt, msg, fid) for _s, fid in flows]
    wc = [window_of(dpc, msg, fid) for _s, fid in flows]

    def per_batch(io, ws, start):  # the caller's path: each run to the windows of its source, in turn
        for addr, a, z in io.runs(start):
            while a < z:
                took = a
                for w, src in zip(ws, srcs):
                    if src == addr:
                        took = w.ingest(io.buffer, io.offsets, io.lengths, a, z)
                        if took > a:
                            break
                a = took if took > a else a + 1  # not DATA of a listed flow: dropped by the caller

    while True:
        ra = ioa.drain_flows(wa, srcs, max_batches, min_dgrams)
        rb = iob.drain_flows(wb, srcs, max_batches, min_dgrams)
        assert ra == rb
        assert ioa.runs(ra[4]) == iob.runs(rb[4])
        per_batch(ioa, wa, ra[4])
        per_batch(iob, wb, rb[4])
        if ra[1] == 0:
            break
    while ioc.recv_batch():
        per_batch(ioc, wc, 0)
    for x, y, z in zip(wa, wb, wc):
        assert bytes(x.dest) == bytes(y.dest) == bytes(z.dest)
        assert (x.received, x.duplicates) == (y.received, y.duplicates) == (z.received, z.duplicates)
        assert np.array_equal(x.bitmap, z.bitmap)
