"""The compiled codec ``ltp_ext._wire`` against its twin ``ltp_ext._wire_py``.

The twin is the specification. Round trips are checked on both; then the two
are run side by side on random valid input, random garbage bytes and random
(also invalid) arguments: they must return equal results or raise the same
exception type (and, for WireError, the same ``reason``).
"""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ext_helpers import compiled

import ltp.errors
import ltp_ext._wire_py as twin


def _compiled():
    return compiled("wire")


@pytest.fixture(scope="module")
def comp():
    return _compiled()


@pytest.fixture(scope="module", params=["compiled", "twin"])
def mod(request):
    return _compiled() if request.param == "compiled" else twin


def outcome(fn, *args):
    """('ok', result) or ('raise', exception type, WireError reason)."""
    try:
        return ("ok", fn(*args))
    except Exception as exc:  # noqa: BLE001 - the type is what we compare
        return ("raise", type(exc), getattr(exc, "reason", None))


def _eq(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and np.array_equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_eq(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def agree(comp, name, *args):
    """Run ``name`` in both implementations and assert they agree; return the twin's outcome."""
    want = outcome(getattr(twin, name), *args)
    got = outcome(getattr(comp, name), *args)
    if want[0] == "ok" and got[0] == "ok":
        assert _eq(got[1], want[1]), (name, args, got, want)
    else:
        assert got == want, (name, args, got, want)
    return want


# ------------------------------------------------------------------ API parity

def test_same_public_api(comp):
    public = {n for n in dir(twin) if not n.startswith("_") and not isinstance(getattr(twin, n), type(os))}
    public -= {"annotations"}
    missing = public - set(dir(comp))
    assert not missing, f"compiled ltp_ext._wire lacks {sorted(missing)}"
    for n in public:
        v = getattr(twin, n)
        if isinstance(v, int):
            assert getattr(comp, n) == v, n
    assert comp.WireError is twin.WireError is ltp.errors.WireError
    assert issubclass(comp.WireError, ValueError)


# ------------------------------------------------------------------ round trips (both)

u8, u16, u32, u64 = (st.integers(0, 2 ** b - 1) for b in (8, 16, 32, 64))
ptypes = st.integers(0, 4)
flags_ok = st.integers(0, 7)


@given(ptype=ptypes, flags=flags_ok, fid=u16, tok=u32, w2=u32, w3=u32)
def test_header_roundtrip(mod, ptype, flags, fid, tok, w2, w3):
    h = mod.pack_header(ptype, flags, fid, tok, w2, w3)
    assert isinstance(h, bytes) and len(h) == mod.HEADER_SIZE == 16
    assert h == struct.pack("!BBHIII", 0x10 | ptype, flags, fid, tok, w2, w3)
    assert mod.unpack_header(h) == (ptype, flags, fid, tok, w2, w3)
    buf = bytearray(40)
    mod.pack_header_into(buf, 7, ptype, flags, fid, tok, w2, w3)
    assert bytes(buf[7:23]) == h and not any(buf[:7]) and not any(buf[23:])
    assert mod.unpack_header(memoryview(bytes(buf)), 7) == (ptype, flags, fid, tok, w2, w3)


def test_header_known_bytes(mod):
    h = mod.pack_header(mod.T_DATA, mod.F_CRITICAL, 0x0102, 0xA0B0C0D0, (5 << 8) | 3, 0x00010002)
    assert h == bytes.fromhex("11 01 0102 a0b0c0d0 00000503 00010002")
    with pytest.raises(mod.WireError) as ei:
        mod.unpack_header(bytes.fromhex("21 00 0000 00000000 00000000 00000000"))
    assert ei.value.reason == "bad_version"
    for raw, reason in (("15 00", "bad_type"), ("11 08", "bad_flags")):
        with pytest.raises(ltp.errors.WireError) as ei:
            mod.unpack_header(bytes.fromhex(raw) + bytes(14))
        assert ei.value.reason == reason
    with pytest.raises(ValueError) as ei:      # WireError is a ValueError
        mod.unpack_header(b"\x11" * 15)
    assert ei.value.reason == "truncated"


@st.composite
def reg_fields(draw):
    elem = draw(st.integers(1, 64))
    seg = elem * draw(st.integers(1, 65535 // elem))
    total = draw(st.integers(1, seg * ((1 << 24) - 1)))
    count = -(-total // seg)
    cuts = sorted(set(draw(st.lists(st.integers(0, count), max_size=2 * 160))))
    ranges = [(a, b) for a, b in zip(cuts[::2], cuts[1::2]) if b > a][:160]
    return total, seg, elem, count, draw(u64), draw(st.integers(0, 1)), ranges


@given(f=reg_fields(), mac=st.none() | st.binary(min_size=16, max_size=16), pre=st.binary(max_size=20),
       stamp=u64)
def test_reg_body_roundtrip(mod, f, mac, pre, stamp):
    total, seg, elem, count, tag, mode, ranges = f
    body = mod.pack_reg_body(total, seg, elem, count, tag, mode, ranges, timestamp_us=stamp)
    assert len(body) == mod.REG_FIXED_SIZE + 8 * len(ranges) == 36 + 8 * len(ranges)
    # the timestamp sits right after the range count (docs/protocol.md)
    assert int.from_bytes(body[28:36], "big") == stamp
    wire = pre + body + (mac or b"")
    got = mod.unpack_reg_body(wire, len(pre), mac is not None)
    assert got == (total, seg, elem, count, tag, mode, ranges, mac, len(pre) + len(body), stamp)


@given(fid=u16, tok=u32, rcv=u32, delay=st.integers(0, 10 ** 7),
       entries=st.lists(u32, max_size=364), off=st.integers(0, 8))
def test_ack_roundtrip(mod, fid, tok, rcv, delay, entries, off):
    d = mod.pack_ack(fid, tok, rcv, delay, np.array(entries, dtype=np.uint32))
    assert len(d) == 16 + 4 * len(entries)
    ptype, flags, fid2, tok2, w2, w3 = mod.unpack_header(d)
    assert (ptype, flags, fid2, tok2, w2, w3 & 0xFFFF) == (mod.T_ACK, 0, fid, tok, rcv, len(entries))
    assert mod.uf16_decode(w3 >> 16) <= delay
    got = mod.unpack_ack_entries(bytes(off) + d, w3, off)
    assert got.dtype == np.uint32 and got.tolist() == entries
    with pytest.raises(mod.WireError) as ei:
        mod.unpack_ack_entries(d + b"\0", w3)
    assert ei.value.reason == "bad_length"
    with pytest.raises(mod.WireError):
        mod.pack_ack(fid, tok, rcv, delay, [0] * 365)


@given(v=st.integers(0, 2 ** 48))
def test_uf16_precision(mod, v):
    code = mod.uf16_encode(v)
    assert 0 <= code <= 0xFFFF
    back = mod.uf16_decode(code)
    if v < 2047 << 31:
        assert back <= v and v - back <= back / 1024 + 1e-9     # rounds down, < 1/1024 error
    else:
        assert code == 0xFFFF
    assert mod.uf16_encode(back) == code
    w = mod.estimates_word(v, v // 3)
    assert mod.split_estimates(w) == (back, mod.uf16_decode(mod.uf16_encode(v // 3)))


def test_uf16_known_values(mod):
    assert [mod.uf16_encode(v) for v in (0, -5, 1, 2047, 2048, 4095, 4096)] == [0, 0, 1, 2047, 0x800 | 1024,
                                                                                  0x800 | 2047, 0x1000 | 1024]
    assert mod.uf16_decode(0xFFFF) == 2047 << 31
    assert mod.uf16_encode(2 ** 200) == 0xFFFF


# ------------------------------------------------------------------ twin agreement

@settings(max_examples=400)
@given(data=st.binary(max_size=80), off=st.integers(-24, 90))
def test_garbage_header(comp, data, off):
    agree(comp, "unpack_header", data, off)
    agree(comp, "unpack_header", bytearray(data), off)


@settings(max_examples=300)
@given(data=st.binary(max_size=40))
def test_garbage_header_with_version_nibble(comp, data):
    # most random bytes fail on the version; force version 1 to reach type and flags checks
    agree(comp, "unpack_header", bytes([0x10 | (data[0] & 0x0F) if data else 0x11]) + data[1:])


@st.composite
def reg_garbage(draw):
    """REG bodies near the valid set: random fields, ranges, MAC and trailing bytes."""
    big = st.integers(0, 2 ** 64 - 1) | st.integers(0, 3000)
    nr = draw(st.integers(0, 5) | st.integers(0, 0xFFFF))
    fields = (draw(big), draw(st.integers(0, 0xFFFF) | st.integers(0, 16)), draw(st.integers(0, 16) | u16),
              draw(u32 | st.integers(0, 300)), draw(u64), draw(st.integers(0, 3)), draw(u8), nr)
    body = struct.pack("!QHHIQBBH", *fields)
    for _ in range(draw(st.integers(0, 6))):
        body += struct.pack("!II", draw(st.integers(0, 300)), draw(st.integers(0, 300)))
    body += draw(st.binary(max_size=40))
    if draw(st.booleans()):
        body = body[:draw(st.integers(0, len(body)))]
    return body


@st.composite
def reg_almost_valid(draw):
    """Consistent sizes and length, so the segment-count and critical-range checks are reached."""
    elem = draw(st.integers(1, 8))
    seg = elem * draw(st.integers(1, 8))
    total = draw(st.integers(1, 400))
    count = -(-total // seg) + draw(st.sampled_from([0, 0, 0, 1, -1]))
    nr = draw(st.integers(0, 6))
    ranges = [(draw(st.integers(0, count + 2)), draw(st.integers(0, count + 2))) for _ in range(nr)]
    if draw(st.booleans()):
        ranges.sort()
    mac = draw(st.booleans())
    body = struct.pack("!QHHIQBBHQ", total, seg, elem, max(count, 0), draw(u64), draw(st.integers(0, 1)), 0, nr,
                       draw(u64))
    body += b"".join(struct.pack("!II", a, b) for a, b in ranges) + (bytes(range(16)) if mac else b"")
    return body, mac


@settings(max_examples=500)
@given(case=reg_almost_valid())
def test_almost_valid_reg_body(comp, case):
    body, mac = case
    agree(comp, "unpack_reg_body", body, 0, mac)
    agree(comp, "unpack_reg_body", bytearray(b"xyz" + body), 3, mac)


@settings(max_examples=500)
@given(body=reg_garbage(), pre=st.binary(max_size=8), mac=st.booleans(), off_delta=st.integers(-40, 4))
def test_garbage_reg_body(comp, body, pre, mac, off_delta):
    wire = pre + body
    agree(comp, "unpack_reg_body", wire, len(pre), mac)
    agree(comp, "unpack_reg_body", wire, len(pre) + off_delta, mac)


@settings(max_examples=300)
@given(data=st.binary(max_size=120), word3=st.integers(-2 ** 40, 2 ** 40) | st.integers(0, 40),
       off=st.integers(-24, 30))
def test_garbage_ack_entries(comp, data, word3, off):
    agree(comp, "unpack_ack_entries", data, word3, off)
    n = len(data) // 4
    agree(comp, "unpack_ack_entries", bytes(16) + data[:4 * n], n)


anyint = (st.integers(-5, 300) | st.integers(-2 ** 70, 2 ** 70) | st.integers(0, 2 ** 32 + 5)
          | st.sampled_from([True, np.uint8(7), np.int64(-1), np.uint32(2 ** 32 - 1), 1.5, "3", None]))


@settings(max_examples=400)
@given(args=st.tuples(*[anyint] * 6))
def test_pack_header_arguments(comp, args):
    agree(comp, "pack_header", *args)
    buf_c, buf_p = bytearray(20), bytearray(20)
    got = outcome(comp.pack_header_into, buf_c, 2, *args)
    want = outcome(twin.pack_header_into, buf_p, 2, *args)
    assert got == want
    if got[0] == "ok":
        assert buf_c == buf_p
    else:
        # the compiled codec checks every field before writing (the twin's struct.pack_into
        # may leave the fields before the bad one written)
        assert buf_c == bytearray(20)


@given(off=st.integers(-40, 40), target=st.sampled_from(["bytearray", "bytes", "memoryview", "array"]))
def test_pack_header_into_targets(comp, off, target):
    def make():
        return {"bytearray": bytearray(24), "bytes": bytes(24), "memoryview": memoryview(bytearray(24)),
                "array": np.zeros(24, dtype=np.uint8)}[target]
    tc, tp = make(), make()
    got = outcome(comp.pack_header_into, tc, off, 1, 2, 3, 4, 5, 6)
    want = outcome(twin.pack_header_into, tp, off, 1, 2, 3, 4, 5, 6)
    assert got == want
    assert bytes(tc) == bytes(tp)


@settings(max_examples=300)
@given(v=anyint | st.floats(allow_nan=False, allow_infinity=False, width=32))
def test_uf16_arguments(comp, v):
    for name in ("uf16_encode", "uf16_decode", "split_estimates"):
        agree(comp, name, v)
    agree(comp, "estimates_word", v, 5000)


@settings(max_examples=300)
@given(args=st.tuples(*[anyint] * 6), ranges=st.lists(st.tuples(anyint, anyint), max_size=3)
       | st.lists(st.tuples(st.integers(0, 9)), max_size=2) | st.just([(1, 2)] * 161))
def test_pack_reg_body_arguments(comp, args, ranges):
    agree(comp, "pack_reg_body", *args, ranges)
    agree(comp, "pack_reg_body", *args[:6], [], args[0])  # timestamp_us: same checks as the other fields


@settings(max_examples=300)
@given(head=st.tuples(anyint, anyint, anyint, anyint),
       entries=st.lists(st.integers(0, 2 ** 32 - 1), max_size=400)
       | st.lists(st.integers(-3, 2 ** 33), max_size=5)
       | st.sampled_from([np.arange(6, dtype=np.uint32)[::2], np.ones((2, 3), dtype=np.uint32), 5, [],
                          np.array([1.7, 2.2])]))
def test_pack_ack_arguments(comp, head, entries):
    agree(comp, "pack_ack", *head, entries)


@settings(max_examples=300)
@given(head=st.tuples(u16, u32, u32, st.integers(0, 10 ** 7)),
       entries=st.lists(u32, max_size=366) | st.sampled_from([np.ones((2, 3), dtype=np.uint32), 5, []]),
       grant=st.integers(-5, 2 ** 45) | st.sampled_from([0, 1, 2.7, True, 2 ** 70]))
def test_pack_ack_with_a_grant_agrees(comp, head, entries, grant):
    agree(comp, "pack_ack", *head, entries, grant)


@settings(max_examples=300)
@given(data=st.binary(max_size=40), flags=st.integers(-300, 300) | st.sampled_from([8, 0, 2.0, 8.9]),
       off=st.integers(-40, 30))
def test_garbage_ack_grant_agrees(comp, data, flags, off):
    agree(comp, "ack_grant", data, flags, off)
    agree(comp, "unpack_ack_entries", data, len(data) // 4, off, flags)


@given(fid=u16, tok=u32, rcv=u32, grant=st.integers(1, 2 ** 40), entries=st.lists(u32, max_size=363),
       off=st.integers(0, 8))
def test_granted_ack_roundtrip(mod, fid, tok, rcv, grant, entries, off):
    d = mod.pack_ack(fid, tok, rcv, 0, np.array(entries, dtype=np.uint32), grant)
    assert len(d) == 20 + 4 * len(entries)
    ptype, flags, fid2, tok2, w2, w3 = mod.unpack_header(d)
    assert (ptype, flags, fid2, tok2, w2) == (mod.T_ACK, mod.F_GRANT, fid, tok, rcv)
    got = mod.ack_grant(bytes(off) + d, flags, off)
    assert got <= grant and (grant < 2048 and got == grant or got > grant * (1 - 1 / 1024))
    assert mod.unpack_ack_entries(bytes(off) + d, w3, off, flags).tolist() == entries
    assert mod.ack_grant(d, 0) == 0  # no flag, no grant
    with pytest.raises(mod.WireError) as ei:
        mod.unpack_ack_entries(d, w3)  # read without the flag, the grant word breaks the count
    assert ei.value.reason == "bad_length"
    with pytest.raises(mod.WireError) as ei:
        mod.pack_ack(fid, tok, rcv, 0, [0] * 364, grant)  # one entry less room with a grant
    assert ei.value.reason == "too_many_entries"


def test_grant_flag_is_refused_outside_an_ack_and_reserved_bits_are_checked(mod):
    for ptype in (mod.T_REG, mod.T_DATA, mod.T_STOP, mod.T_RESET):
        with pytest.raises(mod.WireError) as ei:
            mod.unpack_header(mod.pack_header(ptype, mod.F_GRANT, 1, 1, 0, 0))
        assert ei.value.reason == "bad_flags"
    good = bytearray(mod.pack_ack(1, 1, 0, 0, [7], 1000))
    assert mod.ack_grant(bytes(good), mod.F_GRANT) == 1000
    good[19] = 1  # a reserved bit of the grant word
    with pytest.raises(mod.WireError) as ei:
        mod.ack_grant(bytes(good), mod.F_GRANT)
    assert ei.value.reason == "bad_grant"
    with pytest.raises(mod.WireError) as ei:
        mod.ack_grant(bytes(good[:18]), mod.F_GRANT)
    assert ei.value.reason == "truncated"
    zero = bytes(good[:16]) + bytes(4)  # a grant word that grants nothing
    with pytest.raises(mod.WireError) as ei:
        mod.ack_grant(zero, mod.F_GRANT)
    assert ei.value.reason == "bad_grant"
