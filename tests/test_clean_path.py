"""Redundant control datagrams only where loss was seen (``ltp.path.CLEAN_PATH_PACKETS``).

Two control datagrams of every message insure against loss: the second REG copy (``Config.reg_copies``) and the
guard STOP a receiver sends behind the ACK that completes a message. Together they were two of a small message's five
datagrams and about a fifth of its CPU. A path that has delivered ``CLEAN_PATH_PACKETS`` packets in a row with nothing
lost registers with one REG, and a receiver that read one REG copy sends no guard STOP. A lost REG or completing ACK
on such a path still ends the message (RESET ``unregistered`` or the probe timeout recover it), and the loss makes
the path unclean again, so the next messages carry the insurance.
"""

from __future__ import annotations

import numpy as np
import pytest

from ltp import wire
from ltp.config import Config
from ltp.path import CLEAN_PATH_PACKETS

MSG_FLOATS = 7500  # 30 kB: 21 packets
PACKETS_PER_MSG = 21


def _kind(d) -> int:
    return d[0] & 0x0F


def _fid(d) -> int:
    return wire.unpack_header(d)[2]


def _entries(d) -> int:
    return wire.unpack_header(d)[5] & 0xFFFF


class _Tap:
    """A link's ``drop_if``: records every datagram by (kind, flow id); drops those ``drop(d)`` says to."""

    def __init__(self):
        self.seen: list = []
        self.drop = None
        self.dropped: list = []

    def __call__(self, d) -> bool:
        d = bytes(d)
        if self.drop is not None and self.drop(d):
            self.dropped.append(d)
            return True
        self.seen.append(d)
        return False

    def of(self, fid: int, kind: int) -> list:
        return [d for d in self.seen + self.dropped if _kind(d) == kind and _fid(d) == fid]


def _pair(harness, *, seed: int = 0, loss: float = 0.0, config: Config | None = None):
    h = harness(seed=seed, config=config or Config())
    up, down = _Tap(), _Tap()
    # loss of DATA only (every datagram over 200 bytes, as the lab's rule): control datagrams are the taps' to drop
    h.link(0, 1, rate=125e6, delay_s=0.001, drop_if=up, loss=loss, loss_min_size=200)
    h.link(1, 0, rate=125e6, delay_s=0.001, drop_if=down)
    return h, up, down


def _message(h, k: int):
    """Send message ``k`` from host 0 to host 1, wait for both ends and check the bytes; returns its flow id."""
    data = np.arange(MSG_FLOATS, dtype=np.float32) + k
    buf = np.zeros_like(data)
    eng = h.engines[0]
    hs = eng.send(h.addrs[1], data, now=h.now, reliable=True, tag=k)
    fid = eng._tx_by_handle[hs].flow_id
    hr = h.engines[1].post_receive([(h.addrs[0], k, buf)], now=h.now)
    got, sent = h.wait([(1, hr), (0, hs)], timeout=30)
    assert sent.error is None and got.error is None and np.array_equal(buf, data), (sent, got)
    return fid


def _path(h):
    return h.engines[0]._paths[h.addrs[1]]


def _until_clean(h) -> list:
    fids = []
    for k in range(3 * CLEAN_PATH_PACKETS // PACKETS_PER_MSG):
        fids.append(_message(h, k))
        if _path(h).clean:
            return fids
    raise AssertionError(f"the path is not clean after {len(fids)} loss-free messages: {_path(h).clean_packets}")


def test_a_new_path_takes_the_insurance_and_a_loss_free_one_drops_it(harness):
    h, up, down = _pair(harness)
    fids = _until_clean(h)
    # the first messages: two REG copies each, and the receiver's guard STOP behind the completing ACK
    first = fids[0]
    assert len(up.of(first, wire.T_REG)) == Config().reg_copies == 2
    assert len(down.of(first, wire.T_STOP)) == 1
    # it took about CLEAN_PATH_PACKETS packets (REG answers and ACKs acknowledge DATA only)
    assert len(fids) * PACKETS_PER_MSG >= CLEAN_PATH_PACKETS
    assert (len(fids) - 1) * PACKETS_PER_MSG < CLEAN_PATH_PACKETS
    # from now on: one REG, no STOP, every message still exact (checked in _message)
    later = [_message(h, 1000 + k) for k in range(5)]
    for fid in later:
        assert len(up.of(fid, wire.T_REG)) == 1, fid
        assert down.of(fid, wire.T_STOP) == [], fid
        assert any(_entries(d) for d in down.of(fid, wire.T_ACK))
    assert h.engines[0].stats.late_answers == len(fids)  # the guard STOPs of the first messages, and no more


@pytest.mark.parametrize("seed", [0, 1])
def test_a_path_that_loses_data_keeps_both_copies_and_the_guard(harness, seed):
    h, up, down = _pair(harness, seed=seed, loss=0.01)
    fids = [_message(h, k) for k in range(2 * CLEAN_PATH_PACKETS // PACKETS_PER_MSG)]
    assert up.of(fids[0], wire.T_REG)  # (the tap sees them)
    assert all(len(up.of(f, wire.T_REG)) >= 2 for f in fids)
    assert all(len(down.of(f, wire.T_STOP)) >= 1 for f in fids)
    assert h.net.link(h.addrs[0], h.addrs[1]).stats["lost"] > 0


def _send_losing_its_completing_ack(h, down, tag: int):
    """On a clean path, send a message from host 0 to host 1 whose ACKs with entries (the completing one among
    them) are dropped, and post its receive; returns (send handle, receive handle, flow id, data, buffer)."""
    _until_clean(h)
    target = {}

    def drop(d):  # the ACKs with entries of the next flow: the completing one among them
        return _kind(d) == wire.T_ACK and _fid(d) == target.get("fid") and _entries(d) > 0

    down.drop = drop
    eng = h.engines[0]
    data = np.arange(MSG_FLOATS, dtype=np.float32)
    buf = np.zeros_like(data)
    hs = eng.send(h.addrs[1], data, now=h.now, reliable=True, tag=tag)
    target["fid"] = eng._tx_by_handle[hs].flow_id
    hr = h.engines[1].post_receive([(h.addrs[0], tag, buf)], now=h.now)
    return hs, hr, target["fid"], data, buf


def test_a_lost_completing_ack_on_a_clean_path_ends_the_send_and_unclean_it(harness):
    h, up, down = _pair(harness)
    hs, hr, fid, data, buf = _send_losing_its_completing_ack(h, down, 7)
    t0 = h.now
    got, sent = h.wait([(1, hr), (0, hs)], timeout=30)
    assert got.error is None and np.array_equal(buf, data)
    assert sent.error is None, sent
    assert down.dropped and down.of(fid, wire.T_STOP), "the closed flow's STOP answered the probe"
    assert h.now - t0 < 0.05, h.now - t0  # a probe timeout of a 2 ms round trip, not the dead-peer limit
    assert not _path(h).clean  # the probe declared the window lost
    down.drop = None
    fid = _message(h, 8)
    assert len(up.of(fid, wire.T_REG)) == 2 and len(down.of(fid, wire.T_STOP)) == 1


def test_a_lost_single_reg_on_a_clean_path_costs_a_round_trip_and_unclean_it(harness):
    h, up, down = _pair(harness)
    _until_clean(h)
    dropped = []

    def drop(d):  # the next REG (the only copy)
        if _kind(d) == wire.T_REG and not dropped:
            dropped.append(d)
            return True
        return False

    up.drop = drop
    t0 = h.now
    fid = _message(h, 9)
    assert dropped and _fid(dropped[0]) == fid
    assert h.now - t0 < 0.05, h.now - t0  # RESET unregistered, then REG again: round trips, not a back-off
    assert h.engines[0].stats.reregistrations + (len(up.of(fid, wire.T_REG)) > 1) >= 1
    assert not _path(h).clean
    up.drop = None
    fid = _message(h, 10)
    assert len(up.of(fid, wire.T_REG)) == 2


def test_reg_copies_one_sends_one_copy_and_no_guard_from_the_start(harness):
    h, up, down = _pair(harness, config=Config(reg_copies=1))
    fid = _message(h, 0)
    assert len(up.of(fid, wire.T_REG)) == 1 and down.of(fid, wire.T_STOP) == []


def test_clean_counts_acknowledged_packets_and_any_loss_resets_it(harness):
    h, _, _ = _pair(harness)
    _message(h, 0)
    p = _path(h)
    assert 0 < p.clean_packets < CLEAN_PATH_PACKETS and not p.clean
    p.clean_packets = CLEAN_PATH_PACKETS
    assert p.clean
    p.on_tail_loss(0)
    assert p.clean
    p.on_tail_loss(1)
    assert not p.clean and p.clean_packets == 0
    p.clean_packets = CLEAN_PATH_PACKETS
    p.note_loss()
    assert not p.clean


def test_an_endpoint_closed_right_after_a_receive_answers_its_lost_completing_ack(harness):
    """On a clean path no guard STOP follows the completing ACK. If that ACK is lost and the receiver closes at
    once, the sender's probe would find no one: the closing engine sends the STOP of every flow it closed in the
    last ``CLOSING_STOP_WINDOW_S`` instead. Without it this send fails after the dead-peer limit."""
    h, up, down = _pair(harness)
    hs, hr, fid, data, buf = _send_losing_its_completing_ack(h, down, 7)
    (got,) = h.wait([(1, hr)], timeout=30)
    assert got.error is None and np.array_equal(buf, data)
    assert down.dropped and down.of(fid, wire.T_STOP) == []  # the ACK was lost and no guard STOP went
    t0 = h.now
    h.engines[1].close(now=h.now)
    h.net.pump(h.addrs[1])
    (sent,) = h.wait([(0, hs)], timeout=30)
    assert sent.error is None, sent
    assert sent.report.delivered_fraction == 1.0
    assert len(down.of(fid, wire.T_STOP)) == 1
    assert h.now - t0 < 0.01, h.now - t0  # the STOP's one-way trip, not a probe timeout


def test_the_closing_stops_are_the_recent_records_newest_first_and_bounded():
    from collections import deque

    from ltp.admission import Admission
    from ltp.reports import EndpointStats

    adm = Admission(Config(closed_flow_ttl_s=10.0), EndpointStats(), deque())
    for k in range(6):
        adm.remember_closed((("10.0.0.2", 7447), k), 100 + k, 1, k, now=float(k))
    assert [key[1] for key, *_ in adm.recent_closed(5.0, 2.5, 10)] == [5, 4, 3]
    assert adm.recent_closed(5.0, 2.5, 2) == [((("10.0.0.2", 7447), 5), 105, 1, 5),
                                              ((("10.0.0.2", 7447), 4), 104, 1, 4)]
    assert adm.recent_closed(20.0, 1.0, 10) == []
