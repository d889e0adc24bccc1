# cython: language_level=3
"""LTP wire codec, compiled (see docs/protocol.md). Twin: ``ltp_ext._wire_py``.

Theory of operation
-------------------
Every datagram starts with a 16-byte big-endian header ``(version|type,
flags, flow_id, token, word2, word3)``.  The functions here translate between
bytes and integers and validate what needs no protocol state, raising
:class:`ltp_ext.errors.WireError` (imported from the same pure module as the
twin, so one ``except`` clause catches both) whose ``reason`` is the drop
counter key.

The twin is the specification: every function here gives the same result,
or raises the same exception type, for every input the twin accepts or
rejects.  Two rules make that hold:

1. The fast path (plain ``int`` arguments in range, bytes-like buffers) runs
   in C: big-endian loads and stores on the raw buffer, no ``struct``.
2. Anything else (numpy integers, negative or huge values, floats) goes
   through a slow path that applies the twin's exact Python expression, and
   integer fields are range-checked like ``struct`` does (``struct.error``
   for out-of-range or non-integer values, ``TypeError`` for a read-only
   target buffer), so misuse fails the same way in both.
"""

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE, PyBUF_WRITABLE
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_AsUnsignedLongLong
from cpython.number cimport PyIndex_Check, PyNumber_Index
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t

import struct as _struct

import numpy as np
cimport numpy as cnp

cnp.import_array()

cdef extern from "Python.h":
    bint PyLong_CheckExact(object o)
    bint PyLong_Check(object o)

VERSION = 1
HEADER_SIZE = 16
T_REG = 0
T_DATA = 1
T_ACK = 2
T_STOP = 3
T_RESET = 4
F_CRITICAL = 0x01
F_RELIABLE = 0x02
F_MAC = 0x04
F_KNOWN = F_CRITICAL | F_RELIABLE | F_MAC
F_GRANT = 0x08  # ACK only: a grant word (the receiver's rate grant to this sender) follows the header
MAC_SIZE = 16
REG_FIXED_SIZE = 36
MAX_ACK_ENTRIES = 364
MAX_RANGES = 160
MAX_SEQ = (1 << 24) - 1

cdef enum:
    _VERSION = 1
    _HEADER_SIZE = 16
    _T_RESET = 4
    _F_KNOWN = 0x07
    _F_GRANT = 0x08
    _T_ACK = 2
    _MAC_SIZE = 16
    _REG_FIXED_SIZE = 36
    _MAX_ACK_ENTRIES = 364
    _MAX_RANGES = 160
    _MAX_SEQ = 0xFFFFFF

cdef object _StructError = _struct.error


# ---------------------------------------------------------------- helpers

cdef inline uint16_t _ld16(const uint8_t *p) noexcept nogil:
    return (<uint16_t>p[0] << 8) | p[1]

cdef inline uint32_t _ld32(const uint8_t *p) noexcept nogil:
    return (<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | p[3]

cdef inline uint64_t _ld64(const uint8_t *p) noexcept nogil:
    return (<uint64_t>_ld32(p) << 32) | _ld32(p + 4)

cdef inline void _st16(uint8_t *p, uint16_t v) noexcept nogil:
    p[0] = v >> 8
    p[1] = v & 0xFF

cdef inline void _st32(uint8_t *p, uint32_t v) noexcept nogil:
    p[0] = v >> 24
    p[1] = (v >> 16) & 0xFF
    p[2] = (v >> 8) & 0xFF
    p[3] = v & 0xFF

cdef inline void _st64(uint8_t *p, uint64_t v) noexcept nogil:
    _st32(p, <uint32_t>(v >> 32))
    _st32(p + 4, <uint32_t>(v & 0xFFFFFFFFu))


cdef uint64_t _field(object o, uint64_t maxv) except? 0xFFFFFFFFFFFFFFFF:
    """An unsigned struct field: ``struct.error`` for non-integers and out-of-range values."""
    cdef int overflow = 0
    cdef long long v
    cdef bint indexed = False
    if not PyLong_Check(o):
        if not PyIndex_Check(o):
            raise _StructError("required argument is not an integer")
        o = PyNumber_Index(o)
        indexed = True
    v = PyLong_AsLongLongAndOverflow(o, &overflow)
    if overflow == 0:
        if v < 0 and indexed and maxv == 0xFFFFFFFFFFFFFFFF:
            # CPython's struct 'Q' lets this OverflowError through for __index__ objects
            raise OverflowError("can't convert negative int to unsigned")
        if v < 0 or <uint64_t>v > maxv:
            raise _StructError("argument out of range")
        return <uint64_t>v
    if overflow > 0 and maxv == 0xFFFFFFFFFFFFFFFF:
        try:
            return PyLong_AsUnsignedLongLong(o)
        except OverflowError:
            pass
    raise _StructError("argument out of range")


cdef inline uint64_t _uf16_enc(uint64_t v) noexcept nogil:
    cdef int bl, e
    if v < 2048:
        return v
    bl = 64 - __builtin_clzll(v)
    e = bl - 11
    if e > 31:
        return 0xFFFF
    return (<uint64_t>e << 11) | (v >> e)


cdef extern from *:
    int __builtin_clzll(unsigned long long x) nogil


cdef uint64_t _uf16_encode_obj(object value) except? 0xFFFFFFFFFFFFFFFF:
    """``uf16_encode`` on any object, with the twin's ``int(value)`` semantics."""
    cdef int overflow = 0
    cdef long long v
    if not PyLong_CheckExact(value):
        value = int(value)
    v = PyLong_AsLongLongAndOverflow(value, &overflow)
    if overflow > 0:
        return 0xFFFF
    if overflow < 0 or v <= 0:
        return 0
    return _uf16_enc(<uint64_t>v)


cdef inline uint64_t _uf16_dec(uint64_t code) noexcept nogil:
    code &= 0xFFFF
    return (code & 0x7FF) << (code >> 11)


cdef uint64_t _mask_obj(object o, uint64_t mask) except? 0xFFFFFFFFFFFFFFFF:
    """``o & mask`` with Python semantics (two's complement for negatives, any int size)."""
    cdef int overflow = 0
    cdef long long v
    if PyLong_CheckExact(o):
        v = PyLong_AsLongLongAndOverflow(o, &overflow)
        if overflow == 0:
            return (<uint64_t>v) & mask
    return <uint64_t>(o & mask)


cdef inline Py_ssize_t _norm_offset(Py_ssize_t offset, Py_ssize_t size, Py_ssize_t need, str op) except -1:
    """``struct``'s handling of ``offset`` for ``unpack_from``/``pack_into``."""
    if offset < 0:
        if offset + size < 0:
            raise _StructError(f"offset {offset} out of range for {size}-byte buffer")
        offset += size
    if size - offset < need:
        raise _StructError(f"{op} requires a buffer of at least {need + offset} bytes for "
                           f"{'unpacking' if op == 'unpack_from' else 'packing'} {need} bytes at offset "
                           f"{offset} (actual buffer size is {size})")
    return offset


cdef inline void _hdr_store(uint8_t *p, uint64_t b0, uint64_t flags, uint64_t flow_id, uint64_t token,
                            uint64_t word2, uint64_t word3) noexcept nogil:
    p[0] = <uint8_t>b0
    p[1] = <uint8_t>flags
    _st16(p + 2, <uint16_t>flow_id)
    _st32(p + 4, <uint32_t>token)
    _st32(p + 8, <uint32_t>word2)
    _st32(p + 12, <uint32_t>word3)


cdef inline uint64_t _type_byte(object ptype) except? 0xFFFFFFFFFFFFFFFF:
    """``(VERSION << 4) | ptype`` as the twin computes it, then checked as a struct ``B``."""
    cdef int overflow = 0
    cdef long long v
    if PyLong_CheckExact(ptype):
        v = PyLong_AsLongLongAndOverflow(ptype, &overflow)
        if overflow == 0 and 0 <= v < 0x100:
            return (_VERSION << 4) | <uint64_t>v
    return _field((VERSION << 4) | ptype, 0xFF)


# ---------------------------------------------------------------- uf16

def uf16_encode(value):
    """Encode a non-negative integer as the 16-bit mini-float (rounds down, saturates)."""
    return _uf16_encode_obj(value)


def uf16_decode(code):
    """Decode the 16-bit mini-float."""
    cdef int overflow = 0
    cdef long long v
    if PyLong_CheckExact(code):
        v = PyLong_AsLongLongAndOverflow(code, &overflow)
        if overflow == 0:
            return _uf16_dec(<uint64_t>v)
    code = int(code) & 0xFFFF
    return _uf16_dec(<uint64_t>code)


def estimates_word(rtprop_us, btlbw_bps):
    """Word 3 of DATA/REG: RTprop (µs) and BtlBw (bytes/s) as two uf16."""
    return (_uf16_encode_obj(rtprop_us) << 16) | _uf16_encode_obj(btlbw_bps)


def split_estimates(word3):
    """Inverse of :func:`estimates_word`: ``(rtprop_us, btlbw_bps)``."""
    cdef int overflow = 0
    cdef long long v
    if PyLong_CheckExact(word3):
        v = PyLong_AsLongLongAndOverflow(word3, &overflow)
        if overflow == 0:
            # Python's >> on a negative int is arithmetic; uf16_decode masks to 16 bits
            return _uf16_dec(<uint64_t>(v >> 16)), _uf16_dec(<uint64_t>v)
    return uf16_decode(word3 >> 16), uf16_decode(word3 & 0xFFFF)


# ---------------------------------------------------------------- header

def pack_header(ptype, flags, flow_id, token, word2, word3):
    """Return the 16-byte header."""
    cdef uint64_t b0 = _type_byte(ptype)
    cdef uint64_t f = _field(flags, 0xFF)
    cdef uint64_t fid = _field(flow_id, 0xFFFF)
    cdef uint64_t tok = _field(token, 0xFFFFFFFF)
    cdef uint64_t w2 = _field(word2, 0xFFFFFFFF)
    cdef uint64_t w3 = _field(word3, 0xFFFFFFFF)
    out = PyBytes_FromStringAndSize(NULL, _HEADER_SIZE)
    _hdr_store(<uint8_t *>PyBytes_AS_STRING(out), b0, f, fid, tok, w2, w3)
    return out


def pack_header_into(buf, Py_ssize_t offset, ptype, flags, flow_id, token, word2, word3):
    """Write the 16-byte header into ``buf`` at ``offset``."""
    cdef Py_buffer view
    if not PyLong_CheckExact(ptype):
        (VERSION << 4) | ptype   # the twin evaluates this argument first (TypeError)
    try:
        PyObject_GetBuffer(buf, &view, PyBUF_WRITABLE)
    except (BufferError, TypeError):
        raise TypeError(f"argument must be read-write bytes-like object, not {type(buf).__name__}") from None
    try:
        offset = _norm_offset(offset, view.len, _HEADER_SIZE, "pack_into")
        _hdr_store(<uint8_t *>view.buf + offset, _type_byte(ptype), _field(flags, 0xFF),
                   _field(flow_id, 0xFFFF), _field(token, 0xFFFFFFFF), _field(word2, 0xFFFFFFFF),
                   _field(word3, 0xFFFFFFFF))
    finally:
        PyBuffer_Release(&view)


def unpack_header(buf, Py_ssize_t offset=0):
    """Decode a header: ``(type, flags, flow_id, token, word2, word3)``.

    Raises WireError ``truncated``, ``bad_version``, ``bad_type`` or ``bad_flags``.
    """
    cdef Py_buffer view
    cdef const uint8_t *p
    cdef uint8_t b0, flags, ptype
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    try:
        if view.len - offset < _HEADER_SIZE:
            raise WireError("truncated", "shorter than the 16-byte header")
        offset = _norm_offset(offset, view.len, _HEADER_SIZE, "unpack_from")
        p = <const uint8_t *>view.buf + offset
        b0 = p[0]
        flags = p[1]
        if b0 >> 4 != _VERSION:
            raise WireError("bad_version", f"version {b0 >> 4}")
        ptype = b0 & 0x0F
        if ptype > _T_RESET:
            raise WireError("bad_type", f"type {ptype}")
        if flags & ~(_F_KNOWN | _F_GRANT) or (flags & _F_GRANT and ptype != _T_ACK):
            raise WireError("bad_flags", f"flags {flags:#x}")
        return ptype, flags, _ld16(p + 2), _ld32(p + 4), _ld32(p + 8), _ld32(p + 12)
    finally:
        PyBuffer_Release(&view)


# ---------------------------------------------------------------- REG body

def pack_reg_body(total, segment_size, element_size, segment_count, tag, mode, ranges, timestamp_us=0):
    """Encode the REG body without the MAC (append it separately when keyed).

    ``timestamp_us`` is the sender's wall clock (µs since the Unix epoch) when
    this copy of the REG was sent: the freshness the MAC binds (docs/protocol.md).
    """
    cdef Py_ssize_t nr, i
    cdef uint8_t *p
    ranges = list(ranges)
    nr = len(ranges)
    if nr > _MAX_RANGES:
        raise WireError("too_many_ranges", f"{nr} > {MAX_RANGES}")
    cdef uint64_t t = _field(total, 0xFFFFFFFFFFFFFFFF)
    cdef uint64_t seg = _field(segment_size, 0xFFFF)
    cdef uint64_t elem = _field(element_size, 0xFFFF)
    cdef uint64_t cnt = _field(segment_count, 0xFFFFFFFF)
    cdef uint64_t tg = _field(tag, 0xFFFFFFFFFFFFFFFF)
    cdef uint64_t md = _field(mode, 0xFF)
    cdef uint64_t ts = _field(timestamp_us, 0xFFFFFFFFFFFFFFFF)
    out = PyBytes_FromStringAndSize(NULL, _REG_FIXED_SIZE + 8 * nr)
    p = <uint8_t *>PyBytes_AS_STRING(out)
    _st64(p, t)
    _st16(p + 8, <uint16_t>seg)
    _st16(p + 10, <uint16_t>elem)
    _st32(p + 12, <uint32_t>cnt)
    _st64(p + 16, tg)
    p[24] = <uint8_t>md
    p[25] = 0
    _st16(p + 26, <uint16_t>nr)
    _st64(p + 28, ts)
    p += _REG_FIXED_SIZE
    for i in range(nr):
        a, b = ranges[i]
        _st32(p, <uint32_t>_field(a, 0xFFFFFFFF))
        _st32(p + 4, <uint32_t>_field(b, 0xFFFFFFFF))
        p += 8
    return out


def unpack_reg_body(buf, Py_ssize_t offset, has_mac):
    """Decode a REG body at ``offset``.

    Returns ``(total, segment_size, element_size, segment_count, tag, mode,
    ranges, mac, mac_end, timestamp_us)`` where ``mac`` is None without the MAC flag and
    ``mac_end`` is the offset where MAC coverage ends. Validates sizes and the
    range list (sorted, non-overlapping, inside the message); raises WireError
    ``truncated``, ``bad_registration`` or ``trailing_bytes``.
    """
    cdef Py_buffer view
    cdef const uint8_t *p
    cdef Py_ssize_t n, pos, need, i, start
    cdef uint64_t total, count, tag, stamp
    cdef uint32_t seg, elem, mode, nr, a, b, prev
    cdef bint mac_flag = has_mac
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    try:
        n = view.len
        if n - offset < _REG_FIXED_SIZE:
            raise WireError("truncated", "registration body")
        start = _norm_offset(offset, n, _REG_FIXED_SIZE, "unpack_from")
        p = <const uint8_t *>view.buf + start
        total = _ld64(p)
        seg = _ld16(p + 8)
        elem = _ld16(p + 10)
        count = _ld32(p + 12)
        tag = _ld64(p + 16)
        mode = p[24]
        nr = _ld16(p + 26)
        stamp = _ld64(p + 28)
        # like the twin, positions continue from the caller's offset (not the normalized one)
        pos = offset + _REG_FIXED_SIZE
        need = nr * 8 + (_MAC_SIZE if mac_flag else 0)
        if nr > _MAX_RANGES or n - pos < need:
            raise WireError("truncated", "registration ranges")
        if n - pos > need:
            raise WireError("trailing_bytes", "registration")
        if seg == 0 or elem == 0 or seg % elem or total == 0 or mode > 1:
            raise WireError("bad_registration", "sizes or mode")
        # ceil(total / seg) without the 64-bit overflow of (total + seg - 1)
        if count != total // seg + (total % seg != 0) or count > _MAX_SEQ + 1:
            raise WireError("bad_registration", "segment count")
        ranges = []
        prev = 0
        for i in range(nr):
            start = _norm_offset(pos, n, 8, "unpack_from")
            a = _ld32(<const uint8_t *>view.buf + start)
            b = _ld32(<const uint8_t *>view.buf + start + 4)
            pos += 8
            if a < prev or b <= a or b > count:
                raise WireError("bad_registration", "critical ranges")
            ranges.append((a, b))
            prev = b
        if mac_flag:
            mac = buf[pos:pos + _MAC_SIZE]
            mac = bytes(mac)
        else:
            mac = None
        return total, seg, elem, count, tag, mode, ranges, mac, pos, stamp
    finally:
        PyBuffer_Release(&view)


# ---------------------------------------------------------------- ACK

def pack_ack(flow_id, token, received, ack_delay_us, entries, grant=0):
    """Encode one ACK datagram; ``entries`` are ``seq << 8 | attempt`` integers (<= 364).

    ``grant`` > 0 (bytes/s, the receiver's rate grant to this sender, sent as ``uf16``)
    sets ``F_GRANT`` and adds the grant word after the header, leaving room for one
    entry fewer (363)."""
    cdef cnp.ndarray arr
    cdef Py_ssize_t n, i, cap, extra
    cdef const uint32_t *src
    cdef uint8_t *p
    arr = np.asarray(entries, dtype=np.uint32)
    if arr.ndim == 0:
        raise IndexError("tuple index out of range")   # the twin's entries.shape[0]
    n = arr.shape[0]
    g = int(grant)
    cdef bint granted = g > 0
    cap = _MAX_ACK_ENTRIES - 1 if granted else _MAX_ACK_ENTRIES
    if n > cap:
        raise WireError("too_many_entries", f"{n} > {cap}")
    cdef uint64_t word3 = (_uf16_encode_obj(ack_delay_us) << 16) | <uint64_t>n
    cdef uint64_t w2 = _mask_obj(received, 0xFFFFFFFF)
    cdef uint64_t fid = _field(flow_id, 0xFFFF)
    cdef uint64_t tok = _field(token, 0xFFFFFFFF)
    cdef uint64_t gword = (_uf16_encode_obj(g) << 16) if granted else 0
    extra = 4 if granted else 0
    if arr.ndim != 1 or not cnp.PyArray_IS_C_CONTIGUOUS(arr):
        # unusual shapes: the twin's exact expression
        head = pack_header(T_ACK, _F_GRANT if granted else 0, flow_id, token, w2, word3)
        if granted:
            head += gword.to_bytes(4, "big")
        return head + arr.astype(">u4").tobytes()
    out = PyBytes_FromStringAndSize(NULL, _HEADER_SIZE + extra + 4 * n)
    p = <uint8_t *>PyBytes_AS_STRING(out)
    _hdr_store(p, (_VERSION << 4) | 2, _F_GRANT if granted else 0, fid, tok, w2, word3)
    p += _HEADER_SIZE
    if granted:
        _st32(p, <uint32_t>gword)
        p += 4
    src = <const uint32_t *>cnp.PyArray_DATA(arr)
    for i in range(n):
        _st32(p + 4 * i, src[i])
    return out


def ack_grant(buf, flags, Py_ssize_t offset=0):
    """The rate grant (bytes/s) an ACK carries; 0 without ``F_GRANT``.

    Raises WireError ``truncated`` (no room for the grant word) or ``bad_grant``
    (its reserved low 16 bits are not zero, or it grants nothing)."""
    cdef Py_buffer view
    cdef Py_ssize_t start
    cdef uint32_t word
    cdef uint64_t grant
    if not _mask_obj(int(flags), _F_GRANT):
        return 0
    start = offset + _HEADER_SIZE
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    try:
        if view.len - start < 4:
            raise WireError("truncated", "ACK flagged GRANT without its grant word")
        start = _norm_offset(start, view.len, 4, "unpack_from")
        word = _ld32(<const uint8_t *>view.buf + start)
        if word & 0xFFFF:
            raise WireError("bad_grant", "reserved bits of the grant word are set")
        grant = _uf16_dec(word >> 16)
        if grant == 0:
            raise WireError("bad_grant", "a zero grant")
        return grant
    finally:
        PyBuffer_Release(&view)


def unpack_ack_entries(buf, word3, Py_ssize_t offset=0, flags=0):
    """Return the ACK entries as a native uint32 array; checks the length matches the count.

    ``flags`` (the header's): with ``F_GRANT`` the entries start after the grant word."""
    cdef Py_buffer view
    cdef Py_ssize_t n, start, i
    cdef const uint8_t *p
    cdef uint32_t *dst
    cdef cnp.npy_intp dims[1]
    cdef cnp.ndarray out
    n = <Py_ssize_t>_mask_obj(word3, 0xFFFF)
    start = offset + _HEADER_SIZE + (4 if _mask_obj(int(flags), _F_GRANT) else 0)
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    try:
        if n > _MAX_ACK_ENTRIES or view.len - start != 4 * n:
            raise WireError("bad_length", "ACK entry count does not match datagram length")
        if start < 0:
            raise ValueError(f"offset must be non-negative and no greater than buffer length ({view.len})")
        dims[0] = n
        out = cnp.PyArray_EMPTY(1, dims, cnp.NPY_UINT32, 0)
        dst = <uint32_t *>cnp.PyArray_DATA(out)
        p = <const uint8_t *>view.buf + start
        for i in range(n):
            dst[i] = _ld32(p + 4 * i)
        return out
    finally:
        PyBuffer_Release(&view)


from .errors import WireError
