"""Placement hints (ltp/placement.py): an expected message that arrives before its receive lands in place."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ltp
from ltp.config import Config
from ltp.engine import Engine
from ltp.errors import LocalProtocolError
from ltp.matching import CLAIM_STEP_BYTES
from ltp.placement import PlacementHints, overlap, overlapping_pair, same_memory
from ltp.timers import Timer

GBIT = 125e6  # bytes/s


# ---------------------------------------------------------------------------- the hint table alone
def test_a_hint_is_used_once_and_only_by_a_message_that_fits():
    hints = PlacementHints()
    buf = memoryview(bytearray(100))
    hints.add(("h", 1), 7, buf)
    assert hints.take(("h", 1), 7, 101) is None and len(hints) == 1  # too large: left for the receive to drop
    assert hints.take(("h", 2), 7, 10) is None and hints.take(("h", 1), 8, 10) is None
    got = hints.take(("h", 1), 7, 60)
    assert len(got) == 60 and same_memory(got, buf[:60]) and hints.used == 1
    assert hints.take(("h", 1), 7, 60) is None  # used up


def test_a_posted_receive_or_a_newer_hint_drops_the_old_one_and_the_table_is_bounded():
    hints = PlacementHints(max_hints=3)
    a, b = memoryview(bytearray(8)), memoryview(bytearray(8))
    hints.add("p", 1, a)
    hints.add("p", 1, b)  # replaces
    assert hints.dropped == 1 and same_memory(hints.take("p", 1, 8), b)
    hints.add("p", 2, a)
    hints.discard("p", 2)
    assert hints.dropped == 2 and len(hints) == 0
    bufs = [memoryview(bytearray(8)) for _ in range(5)]
    for t in range(5):
        hints.add("p", t, bufs[t])
    assert len(hints) == 3 and hints.take("p", 0, 1) is None and hints.take("p", 4, 1) is not None  # oldest went
    hints.clear()
    assert len(hints) == 0


def test_one_buffer_waits_for_one_message_a_new_hint_on_it_drops_the_old():
    """A PS hints the same gradient buffer every round under a new tag: the last round's unused hint goes."""
    hints = PlacementHints()
    buf = memoryview(bytearray(64))
    hints.add("w0", 1, buf)
    hints.add("w0", 2, buf)
    assert len(hints) == 1 and hints.take("w0", 1, 8) is None and hints.dropped == 1
    hints.add("w1", 3, buf[:32])  # another peer, same start: still one buffer
    assert len(hints) == 1 and hints.take("w0", 2, 8) is None
    assert same_memory(hints.take("w1", 3, 32), buf[:32])
    hints.add("w0", 4, buf[8:])  # another start in the same buffer: a separate destination
    hints.add("w0", 5, buf[:8])
    assert len(hints) == 2


def test_same_memory_and_overlap_compare_addresses_not_contents():
    raw = bytearray(b"x" * 32)
    v = memoryview(raw)
    assert same_memory(v, memoryview(raw)) and same_memory(v[4:12], v[4:12])
    assert not same_memory(v[:8], v[:9]) and not same_memory(v[:8], v[1:9])
    assert not same_memory(v, memoryview(bytearray(b"x" * 32)))  # equal bytes, other memory
    assert overlap(v[:8], v[7:9]) and overlap(v[4:6], v) and not overlap(v[:8], v[8:16])
    assert not overlap(v, memoryview(bytearray(32))) and not overlap(v[:0], v)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 12)), min_size=0, max_size=8))
def test_property_overlapping_pair_finds_a_shared_byte_iff_any_pair_shares_one(spans):
    """Views of one 64-byte buffer (some empty), against every pair checked with :func:`overlap`."""
    v = memoryview(bytearray(64))
    views = [v[a:a + n] for a, n in spans]
    pairs = [(i, j) for i in range(len(views)) for j in range(i + 1, len(views)) if overlap(views[i], views[j])]
    got = overlapping_pair(views)
    assert (got is None) == (not pairs)
    if got is not None:
        assert got in pairs


def test_a_gather_into_buffers_that_share_memory_is_refused():
    """Two messages would write the same bytes: refused before anything is posted, naming both buffers."""
    eng = Engine(Config(), rng=random.Random(0))
    a, b = ("127.0.0.1", 1), ("127.0.0.1", 2)
    buf = bytearray(64)
    for into in ([buf, buf], [memoryview(buf)[:40], memoryview(buf)[32:]], [bytearray(8), buf, memoryview(buf)[63:]]):
        peers = [a, b, ("127.0.0.1", 3)][:len(into)]
        with pytest.raises(LocalProtocolError, match="share memory"):
            eng.post_receive([(p, 5, x) for p, x in zip(peers, into)], now=0.0)
    assert not eng._matcher.groups
    eng.post_receive([(a, 5, memoryview(buf)[:32]), (b, 5, memoryview(buf)[32:])], now=0.0)  # adjacent halves: fine
    assert len(eng._matcher.groups) == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "take", "discard"]), st.integers(0, 3), st.integers(1, 12)),
                max_size=50))
def test_property_hints_match_a_model_dict(ops):
    """Against a plain dict with insertion order: take returns the hinted memory iff it fits, each hint once;
    at most max_hints are kept, the oldest dropped first."""
    hints = PlacementHints(max_hints=3)
    model: dict = {}
    bufs = {t: memoryview(bytearray(8)) for t in range(4)}
    for op, tag, n in ops:
        if op == "add":
            model.pop(tag, None)
            model[tag] = bufs[tag]
            while len(model) > 3:
                model.pop(next(iter(model)))
            hints.add("p", tag, bufs[tag])
        elif op == "take":
            got = hints.take("p", tag, n)
            want = model.get(tag)
            if want is None or n > len(want):
                assert got is None
            else:
                assert same_memory(got, want[:n])
                del model[tag]
        else:
            hints.discard("p", tag)
            model.pop(tag, None)
        assert len(hints) == len(model)


# ---------------------------------------------------------------------------- the engine
def _pair(harness, seed, **kw):
    """Two engines over a 1 Gbit/s link; returns (harness, sender, receiver)."""
    h = harness(seed=seed, **kw)
    h.links(rate=GBIT, delay_s=0.0002)
    return h, h.engines[0], h.engines[1]


def _deliver_unexpected(h, data, tag):
    a = h.engines[0]
    (sent,) = h.wait([(0, a.send(h.addrs[1], data, now=h.now, tag=tag))])
    assert sent.report.close_reason == "acked"


def _deliver_hinted(h, rx, data, tag):
    """Hint a fresh zeroed buffer for ``tag`` from host 0, then deliver ``data`` before any receive; the buffer."""
    into = np.zeros_like(data)
    rx.expect(h.addrs[0], tag, into, now=h.now)
    _deliver_unexpected(h, data, tag)
    return into


def test_a_hinted_message_is_written_in_place_before_its_receive_is_posted(harness, floats):
    h, a, rx = _pair(harness, 71)
    data = floats(200_000)
    into = _deliver_hinted(h, rx, data, 9)
    assert np.array_equal(into, data)  # already there: no receive was posted yet
    assert rx._hints.used == 1 and len(rx._hints) == 0
    assert rx.receive_memory == 0  # the bytes are the caller's: nothing held on the peer's behalf
    (recv,) = h.wait([(1, rx.post_receive([(h.addrs[0], 9, into)], now=h.now))])
    rep = recv.reports[0]
    assert rep.regime == "complete" and rep.received_bytes == data.nbytes
    assert np.array_equal(into, data) and rx.receive_memory == 0
    assert rx._pool.bytes == 0  # the caller's buffer is never kept as a spare


def test_a_large_hinted_message_is_delivered_at_its_posting_without_a_copy_step(harness, floats):
    """A message larger than one claim step would need the CLAIM_COPY timer to be copied; received in place it
    is done the moment its receive is posted."""
    h, a, rx = _pair(harness, 76)
    data = floats((CLAIM_STEP_BYTES + (1 << 20)) // 4, 4)
    into = _deliver_hinted(h, rx, data, 2)
    handle = rx.post_receive([(h.addrs[0], 2, into)], now=h.now)
    ev = rx.next_event()
    assert ev is not None and ev.handle == handle and ev.reports[0].regime == "complete"
    assert rx.timers().get(Timer.CLAIM_COPY) is None and np.array_equal(into, data)


def test_a_hinted_message_needs_no_receive_memory_where_an_internal_buffer_would_not_fit(harness, floats):
    h, a, rx = _pair(harness, 78, configs=[Config(), Config(max_receive_memory=1 << 20)])
    data = floats(400_000)  # 1.6 MB: more than the receiver lets peers hold
    (refused,) = h.wait([(0, a.send(h.addrs[1], data, now=h.now, tag=1))])
    assert refused.error is not None and "out_of_memory" in str(refused.error)
    into = _deliver_hinted(h, rx, data, 2)
    assert np.array_equal(into, data) and rx.receive_memory == 0


def test_a_receive_on_another_buffer_gets_a_copy_and_the_hinted_one_is_not_pooled(harness, floats):
    h, a, rx = _pair(harness, 72)
    data = floats(100_000)
    _deliver_hinted(h, rx, data, 3)
    other = np.zeros(data.size + 10, np.float32)  # larger than the message, another buffer
    (recv,) = h.wait([(1, rx.post_receive([(h.addrs[0], 3, other)], now=h.now))])
    assert recv.reports[0].regime == "complete"
    assert np.array_equal(other[:data.size], data) and rx._pool.bytes == 0


def test_a_receive_posted_first_drops_the_hint_and_a_hint_too_small_is_not_used(harness, floats):
    h, a, rx = _pair(harness, 73)
    data = floats(100_000)
    hinted = np.zeros_like(data)
    rx.expect(h.addrs[0], 4, hinted, now=h.now)
    out = np.zeros_like(data)
    handle = rx.post_receive([(h.addrs[0], 4, out)], now=h.now)
    assert len(rx._hints) == 0 and rx._hints.dropped == 1
    h.wait([(0, a.send(h.addrs[1], data, now=h.now, tag=4)), (1, handle)])
    assert np.array_equal(out, data) and not hinted.any()

    small = np.zeros(data.size // 2, np.float32)
    rx.expect(h.addrs[0], 5, small, now=h.now)
    _deliver_unexpected(h, data, 5)  # does not fit the hint: an internal buffer as before
    assert not small.any() and rx._hints.used == 0 and rx.receive_memory >= data.nbytes
    (recv,) = h.wait([(1, rx.post_receive([(h.addrs[0], 5, out)], now=h.now))])
    assert recv.reports[0].regime == "complete" and np.array_equal(out, data)


def test_a_hinted_lossy_message_cut_short_reads_as_its_bytes_and_zeros(harness, floats):
    """The hinted buffer held stale data; the sender goes silent mid-message: what the receive reports as
    bubbles is zero in the caller's buffer, everything else is the message's."""
    h, a, rx = _pair(harness, 74, configs=[Config(), Config(idle_timeout_s=1.0)])
    data = floats(250_000, 1)
    into = np.full_like(data, 7.0)  # stale contents
    rx.expect(h.addrs[0], 6, into, now=h.now)
    a.send(h.addrs[1], data, now=h.now, tag=6)
    h.net.run(until=h.now + 0.003)
    h.net.stall(h.addrs[0], 3.0)
    h.net.run(until=h.now + 2.0)
    (recv,) = h.wait([(1, rx.post_receive([(h.addrs[0], 6, into)], now=h.now))])
    rep = recv.reports[0]
    assert rep.regime == "timeout" and 0.05 < rep.delivered_fraction < 0.95
    raw = into.view(np.uint8)
    holes = np.zeros(raw.size, bool)
    for lo, hi in rep.bubbles:
        holes[lo:hi] = True
    assert holes.any() and not raw[holes].any()
    assert np.array_equal(raw[~holes], data.view(np.uint8)[~holes])


def test_a_new_hint_on_the_buffer_cancels_the_unclaimed_message_an_old_hint_placed_there(harness, floats):
    """Round i's gradient was placed in the buffer but its receive was never posted (its worker was left out of
    the gather); round i+1 hints the buffer again: the old message is cancelled, its sender told STOP, and
    nothing of it is written over the new one."""
    h, a, rx = _pair(harness, 77)
    old, new = floats(250_000, 5), floats(250_000, 6)
    into = np.zeros_like(old)
    rx.expect(h.addrs[0], 1, into, now=h.now)
    first = a.send(h.addrs[1], old, now=h.now, tag=1)
    h.net.run(until=h.now + 0.002)  # part of it is in, still arriving
    assert rx._hints.used == 1 and rx.receive_memory > 0
    rx.expect(h.addrs[0], 2, into, now=h.now)
    assert rx.stats.dropped.get("placed_message_superseded") == 1 and rx.receive_memory == 0
    (done,) = h.wait([(0, first)])
    assert done.report.close_reason == "cancelled"
    _deliver_unexpected(h, new, 2)
    (recv,) = h.wait([(1, rx.post_receive([(h.addrs[0], 2, into)], now=h.now))])
    assert recv.reports[0].regime == "complete" and np.array_equal(into, new)


def test_expect_refuses_misuse_with_a_fix(harness):
    h = harness(seed=75)
    rx = h.engines[1]
    with pytest.raises(LocalProtocolError, match="tag"):
        rx.expect(h.addrs[0], None, bytearray(8), now=h.now)
    with pytest.raises(LocalProtocolError, match="tag"):
        rx.expect(h.addrs[0], -1, bytearray(8), now=h.now)
    with pytest.raises(LocalProtocolError, match="empty"):
        rx.expect(h.addrs[0], 1, bytearray(0), now=h.now)
    rx.close(now=h.now)
    with pytest.raises(LocalProtocolError):
        rx.expect(h.addrs[0], 1, bytearray(8), now=h.now)


# ---------------------------------------------------------------------------- sockets
def test_endpoint_expect_over_loopback_sockets(floats):
    async def main():
        async with await ltp.open_endpoint(("127.0.0.1", 0)) as ps, \
                await ltp.open_endpoint(("127.0.0.1", 0)) as w:
            data = floats(300_000, 3)
            into = np.zeros_like(data)
            await ps.expect(w.local_addr, into, tag=11)
            await w.send(ps.local_addr, data, tag=11, reliable=True, timeout=10)
            assert np.array_equal(into, data)  # in place before any receive
            rep = await ps.recv(into, peer=w.local_addr, tag=11, timeout=10)
            assert rep.regime == "complete" and np.array_equal(into, data)
            assert ps.engine._hints.used == 1

    asyncio.run(main())
