"""Spare internal receive buffers (ltp/buffer_pool.py): the pool alone, and the engine reusing it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ltp.buffer_pool import SPARE_MIN_BYTES, SPARE_TTL_S, BufferPool
from ltp.config import Config
from ltp.timers import Timer

GBIT = 125e6  # bytes/s


def test_a_freed_buffer_is_taken_again_for_the_same_size_only():
    pool = BufferPool(1000)
    a = pool.take(100)
    assert isinstance(a, bytearray) and len(a) == 100 and not any(a)  # a new one is zero-filled
    pool.give(a, now=0.0)
    assert pool.bytes == 100
    b = pool.take(200)  # another size: a new buffer
    assert b is not a and len(b) == 200 and pool.bytes == 100
    assert pool.take(100) is a and pool.bytes == 0 and pool.reused == 1
    assert pool.take(100) is not a  # it was handed out: never twice


def test_the_newest_spare_is_taken_first_and_the_cap_is_never_exceeded():
    pool = BufferPool(250)
    a, b, c = bytearray(100), bytearray(100), bytearray(100)
    pool.give(a, 0.0)
    pool.give(b, 1.0)
    pool.give(c, 2.0)  # over the cap: not kept
    assert pool.bytes == 200
    assert pool.take(100) is b and pool.take(100) is a
    pool.give(bytearray(0), 0.0)
    assert pool.bytes == 0 and pool.next_expiry() is None


def test_spares_expire_after_the_ttl_counted_from_their_latest_give():
    pool = BufferPool(10_000)
    a, b = bytearray(10), bytearray(20)
    pool.give(a, 0.0)
    pool.give(b, 1.0)
    assert pool.next_expiry() == pytest.approx(SPARE_TTL_S)
    assert pool.take(10) is a
    pool.give(a, 3.0)  # given again: its old entry no longer counts
    assert pool.next_expiry() == pytest.approx(1.0 + SPARE_TTL_S)
    pool.trim(SPARE_TTL_S + 0.5)
    assert pool.bytes == 30  # nothing due yet (a's first give was forgotten)
    pool.trim(1.0 + SPARE_TTL_S)
    assert pool.bytes == 10 and pool.next_expiry() == pytest.approx(3.0 + SPARE_TTL_S)
    pool.trim(3.0 + SPARE_TTL_S)
    assert pool.bytes == 0 and pool.next_expiry() is None and pool.take(10) is not a


def test_a_buffer_under_the_minimum_is_not_kept():
    pool = BufferPool(10_000, min_bytes=100)
    pool.give(bytearray(99), 0.0)
    assert pool.bytes == 0 and pool.next_expiry() is None
    pool.give(bytearray(100), 0.0)
    assert pool.bytes == 100


def test_clear_drops_every_spare_and_a_negative_cap_is_refused():
    pool = BufferPool(100)
    pool.give(bytearray(50), 0.0)
    pool.clear()
    assert pool.bytes == 0 and pool.next_expiry() is None
    with pytest.raises(ValueError, match="cap_bytes"):
        BufferPool(-1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["take", "give", "trim"]), st.integers(1, 4), st.floats(0, 3)),
                max_size=60))
def test_property_the_pool_matches_a_model_of_kept_buffers(ops):
    """Against a plain model: bytes held equal the kept buffers' sizes and never pass the cap; a buffer is
    never both held by a caller and kept; take returns exactly the size asked for; a spare lives TTL."""
    cap = 10
    pool = BufferPool(cap)
    kept: list = []  # [buf, given_at]
    held: list = []
    now = 0.0
    for op, size, dt in ops:
        now += dt
        if op == "take":
            buf = pool.take(size)
            assert len(buf) == size and all(buf is not h for h in held)
            same = [i for i, k in enumerate(kept) if len(k[0]) == size]
            if same:
                assert buf is kept[same[-1]][0]
                del kept[same[-1]]  # by position: list.remove compares equal-content buffers as the same
            held.append(buf)
        elif op == "give" and held:
            buf = held.pop(0)
            pool.give(buf, now)
            if sum(len(k[0]) for k in kept) + len(buf) <= cap:
                kept.append([buf, now])
        else:
            pool.trim(now)
            kept = [k for k in kept if k[1] + SPARE_TTL_S > now]
        assert pool.bytes == sum(len(k[0]) for k in kept) <= cap
        want = min((k[1] for k in kept), default=None)
        assert pool.next_expiry() == (None if want is None else pytest.approx(want + SPARE_TTL_S))


def _send_unexpected(h, data, tag):
    a = h.engines[0]
    (sent,) = h.wait([(0, a.send(h.addrs[1], data, now=h.now, tag=tag))])
    assert sent.report.close_reason == "acked"


def test_the_engine_reuses_an_unexpected_messages_buffer_and_no_byte_of_the_old_message_shows(harness, floats):
    """Round 1's unexpected message is claimed; round 2's, of the same size, lands in the same buffer, and its
    sender goes silent mid-message: the receive that claims it gets round 2's bytes and zeros, never round 1's."""
    rx_cfg = Config(idle_timeout_s=1.0)
    h = harness(seed=61, configs=[Config(), rx_cfg])
    h.links(rate=GBIT, delay_s=0.0002)
    a, rx = h.engines
    first, second = floats(250_000, 1), floats(250_000, 2)
    _send_unexpected(h, first, 1)
    out = np.zeros_like(first)
    (recv,) = h.wait([(1, rx.post_receive([(h.addrs[0], 1, out)], now=h.now))])
    assert np.array_equal(out, first) and rx.receive_memory == 0
    assert rx._pool.bytes == first.nbytes  # kept for the next round
    given_at = h.now
    assert rx.timers().get(Timer.SPARE_EXPIRY) == pytest.approx(given_at + SPARE_TTL_S)

    a.send(h.addrs[1], second, now=h.now, tag=2)
    h.net.run(until=h.now + 0.003)  # about a third of it is in
    assert rx._pool.reused == 1 and rx._pool.bytes == 0
    h.net.stall(h.addrs[0], 3.0)  # the sender goes silent past the receiver's idle timeout
    h.net.run(until=h.now + 2.0)
    out = np.full_like(second, np.nan)
    (recv,) = h.wait([(1, rx.post_receive([(h.addrs[0], 2, out)], now=h.now))])
    rep = recv.reports[0]
    assert rep.regime == "timeout" and 0.05 < rep.delivered_fraction < 0.95
    got = out == second
    assert np.all(got | (out == 0)) and not np.any(out[~got] == first[~got])
    assert np.count_nonzero(~got) >= 0.05 * out.size  # there were holes, and they read as zeros
    assert rx._pool.bytes == second.nbytes


def test_spare_buffers_expire_on_their_timer_and_go_with_close(harness, floats):
    h = harness(seed=62)
    h.links(rate=GBIT, delay_s=0.0002)
    rx = h.engines[1]
    data = floats(50_000)
    _send_unexpected(h, data, 3)
    out = np.zeros_like(data)
    h.wait([(1, rx.post_receive([(h.addrs[0], 3, out)], now=h.now))])
    due = rx.timers().get(Timer.SPARE_EXPIRY)
    assert rx._pool.bytes == data.nbytes and due is not None
    rx.handle_timer(due - 0.01)
    assert rx._pool.bytes == data.nbytes
    rx.handle_timer(due)
    assert rx._pool.bytes == 0 and rx.timers().get(Timer.SPARE_EXPIRY) is None

    _send_unexpected(h, data, 4)
    h.wait([(1, rx.post_receive([(h.addrs[0], 4, out)], now=h.now))])
    assert rx._pool.bytes == data.nbytes
    rx.close(now=h.now)
    assert rx._pool.bytes == 0 and rx.get_timer() is None


def test_the_engine_keeps_no_spare_for_a_small_message(harness, floats):
    """A READY note's few bytes are allocated afresh each time: only buffers of SPARE_MIN_BYTES or more are kept."""
    h = harness(seed=63)
    h.links(rate=GBIT, delay_s=0.0002)
    rx = h.engines[1]
    small = floats(SPARE_MIN_BYTES // 4 - 1)
    _send_unexpected(h, small, 5)
    out = np.zeros_like(small)
    h.wait([(1, rx.post_receive([(h.addrs[0], 5, out)], now=h.now))])
    assert np.array_equal(out, small) and rx._pool.bytes == 0
    assert rx.timers().get(Timer.SPARE_EXPIRY) is None
