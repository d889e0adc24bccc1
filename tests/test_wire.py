"""Codec tests (run against whichever implementation ``ltp.wire`` loaded)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ltp import wire
from ltp.errors import WireError

u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)


@given(st.integers(0, wire.T_RESET), st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7]), u16, u32, u32, u32)
def test_header_round_trip(ptype, flags, fid, token, w2, w3):
    raw = wire.pack_header(ptype, flags, fid, token, w2, w3)
    assert len(raw) == wire.HEADER_SIZE == 16
    assert wire.unpack_header(raw) == (ptype, flags, fid, token, w2, w3)
    buf = bytearray(20)
    wire.pack_header_into(buf, 4, ptype, flags, fid, token, w2, w3)
    assert bytes(buf[4:]) == raw


def test_header_byte_layout_matches_docs():
    raw = wire.pack_header(wire.T_DATA, wire.F_CRITICAL, 0x1234, 0xDEADBEEF, (7 << 8) | 2, 0x00010002)
    assert raw.hex() == "1101" "1234" "deadbeef" "00000702" "00010002"


@pytest.mark.parametrize("raw,reason", [
    (b"\x11" * 15, "truncated"),
    (bytes([0x21]) + bytes(15), "bad_version"),
    (bytes([0x17]) + bytes(15), "bad_type"),
    (bytes([0x11, 0x80]) + bytes(14), "bad_flags"),
])
def test_header_rejects(raw, reason):
    with pytest.raises(WireError) as ei:
        wire.unpack_header(raw)
    assert ei.value.reason == reason


@given(st.integers(0, 2047 << 31))
def test_uf16_rounds_down_within_1_in_1024(v):
    code = wire.uf16_encode(v)
    back = wire.uf16_decode(code)
    assert 0 <= code <= 0xFFFF and back <= v
    assert v - back <= v / 1024 + 1


def test_uf16_saturates_and_small_values_exact():
    assert wire.uf16_decode(wire.uf16_encode(10 ** 15)) == 2047 << 31
    for v in range(0, 2048, 7):
        assert wire.uf16_decode(wire.uf16_encode(v)) == v


@given(st.integers(1, 1 << 40), st.integers(1, 300), st.integers(0, 1 << 64 - 1), st.integers(0, 1),
       st.data())
def test_reg_body_round_trip(total, elems, tag, mode, data):
    elem = data.draw(st.sampled_from([1, 2, 4, 8]))
    seg = elems * elem
    count = (total + seg - 1) // seg
    if count > wire.MAX_SEQ + 1:
        return
    cuts = sorted(set(data.draw(st.lists(st.integers(0, min(count, 10_000)), max_size=8))))
    ranges = [(a, b) for a, b in zip(cuts[::2], cuts[1::2]) if b > a]
    stamp = data.draw(st.integers(0, (1 << 64) - 1))
    body = wire.pack_reg_body(total, seg, elem, count, tag, mode, ranges, timestamp_us=stamp)
    got = wire.unpack_reg_body(body, 0, False)
    assert got[:7] == (total, seg, elem, count, tag, mode, ranges)
    assert got[7] is None and got[8] == len(body) and got[9] == stamp
    mac = bytes(range(16))
    got = wire.unpack_reg_body(body + mac, 0, True)
    assert got[7] == mac and got[8] == len(body) and got[9] == stamp


@pytest.mark.parametrize("mutate,reason", [
    (lambda b: b[:20], "truncated"),
    (lambda b: b + b"x", "trailing_bytes"),
])
def test_reg_body_rejects_bad_framing(mutate, reason):
    body = wire.pack_reg_body(1000, 100, 4, 10, 1, 0, [(0, 2)])
    with pytest.raises(WireError) as ei:
        wire.unpack_reg_body(mutate(body), 0, False)
    assert ei.value.reason == reason


@pytest.mark.parametrize("args", [
    (1000, 100, 4, 11, 1, 0, []),      # wrong segment count
    (1000, 102, 4, 10, 1, 0, []),      # segment not a multiple of the element (would split a float)
    (1000, 100, 4, 10, 1, 2, []),      # unknown mode
    (1000, 100, 4, 10, 1, 0, [(3, 2)]),  # empty range
    (1000, 100, 4, 10, 1, 0, [(0, 4), (3, 5)]),  # overlapping
    (1000, 100, 4, 10, 1, 0, [(9, 11)]),  # past the end
])
def test_reg_body_rejects_invalid_registrations(args):
    body = wire.pack_reg_body(*args)
    with pytest.raises(WireError) as ei:
        wire.unpack_reg_body(body, 0, False)
    assert ei.value.reason == "bad_registration"


@given(st.lists(st.integers(0, 0xFFFFFFFF), max_size=wire.MAX_ACK_ENTRIES), u32, st.integers(0, 10 ** 6))
def test_ack_round_trip(entries, received, delay):
    raw = wire.pack_ack(7, 9, received, delay, entries)
    assert len(raw) == 16 + 4 * len(entries) <= 1472
    ptype, flags, fid, token, w2, w3 = wire.unpack_header(raw)
    assert (ptype, fid, token, w2) == (wire.T_ACK, 7, 9, received)
    got = wire.unpack_ack_entries(raw, w3)
    assert got.dtype == np.uint32 and got.tolist() == entries


def test_ack_length_mismatch_rejected():
    raw = wire.pack_ack(1, 1, 0, 0, [1, 2, 3])
    _, _, _, _, _, w3 = wire.unpack_header(raw)
    with pytest.raises(WireError) as ei:
        wire.unpack_ack_entries(raw[:-1], w3)
    assert ei.value.reason == "bad_length"
