# cython: language_level=3
"""Per-flow data-path kernels, compiled. Twin: ``ltp_ext._datapath_py``.

Theory of operation
-------------------
The twin is the specification (read its docstring for the protocol logic:
segment states, the send log, three-ACK loss detection, the tail-loss
``expire``, receive-side validation and in-place reassembly).  This module
keeps exactly the same state, in the same numpy arrays, and updates it with
the same rules in the same order, so that after any sequence of calls both
implementations hold identical arrays and counters and return equal values.

How it is fast:

1. Every per-segment array the caller can see (``state``, ``attempt``,
   ``critical``, ``bitmap``, ``acks``, ...) is a numpy array owned by the
   window; the C code writes through raw pointers taken from those arrays
   once, at construction (or when the send log grows), so Python and C see
   the same memory.  The attributes are read-only: the arrays can be read
   and indexed but not rebound.
2. The loops (``ingest``, ``build``, ``on_ack``, ``expire``, ...) run in C
   over raw pointers: big-endian header fields are loaded and stored byte
   by byte (gcc turns that into ``bswap``), payloads move with ``memcpy``,
   and no Python object is created per datagram or per ACK entry.  A
   receive window of ``STREAM_COPY_MIN`` bytes or more copies its payloads
   with SSE2 streaming stores on x86-64 (``STREAMING_STORES``): a message
   that large leaves the caches before it is read, and a streaming store
   writes whole lines without first reading them from memory; ``_run``
   ends with a store fence, so whoever reads the message after it returns
   sees every byte.
   ``ingest`` checks the first 8 header bytes (version/type, flags, flow
   id, token) with one masked 64-bit compare and releases the GIL for runs
   of 8 datagrams or more; ``zero_fill_missing`` releases it for its
   ``memset``.  The send window never releases the GIL, because growing the
   send log reallocates arrays.
3. Inputs of the documented types take the fast path: ``seqs``, ``offsets``
   and ``lengths`` as 1-D native int64 arrays, ACK ``entries`` as a 1-D
   native uint32 array, ``out`` a bytearray.  Anything else goes through a
   generic path that converts each element the way the twin does
   (``int(x[k])``), so results stay the same.
4. Misuse fails like the twin where the twin fails cleanly: the same
   :class:`ltp_ext.errors.LocalProtocolError` messages, a ``struct.error``
   (raised by the twin's own ``pack_header_into``) when header fields do
   not fit or ``out`` is too short for a header, and ``ValueError`` when it
   is too short for a payload, after the same partial updates.  Where the
   twin would read out of bounds or index from the end (datagrams outside
   ``buf``, a negative ``start``, negative ACK entries) this module raises
   ``LocalProtocolError`` (negative entries: counts them as ``bad_acks``)
   instead of touching memory it does not own.
"""

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE, PyBUF_WRITABLE
from cpython.number cimport PyNumber_Index
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int32_t, int64_t
from libc.string cimport memcpy, memmove, memset

import numpy as np
cimport numpy as cnp

SEG_PENDING = 0
SEG_INFLIGHT = 1
SEG_ACKED = 2
SEG_LOST = 3

from .constants import PACKET_REORDER_THRESHOLD, SEND_BATCH_MIN, SEND_THREADS_MAX, STREAM_COPY_MIN
from .errors import LocalProtocolError

from ._wire_py import pack_header_into as _py_pack_header_into

cnp.import_array()

# the loss rule's threshold as a C int (named in ltp_ext/constants.py)
cdef int _REORDER = PACKET_REORDER_THRESHOLD
# the most lanes one batch may be built in (SendWindow.build(lanes=)): one per sender thread
cdef enum:
    _MAX_LANES = 8
assert SEND_THREADS_MAX == _MAX_LANES, "ltp_ext/constants.py SEND_THREADS_MAX and _datapath.pyx _MAX_LANES must agree"

cdef extern from "Python.h":
    bint PyByteArray_CheckExact(object o)

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    #if defined(__x86_64__) || defined(_M_X64)
    #include <emmintrin.h>
    #define LTP_HAVE_STREAM 1
    /* Copy n bytes with 16-byte streaming stores: an ordinary head up to d's 16-byte alignment, then whole
       16-byte stores that bypass the caches (write-combined into full lines), then an ordinary tail. */
    static inline void ltp_stream_copy(uint8_t *d, const uint8_t *s, size_t n) {
        size_t head = (16 - ((uintptr_t)d & 15)) & 15;
        if (head > n) head = n;
        memcpy(d, s, head); d += head; s += head; n -= head;
        while (n >= 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + 32)), e = _mm_loadu_si128((const __m128i *)(s + 48));
            _mm_stream_si128((__m128i *)d, a); _mm_stream_si128((__m128i *)(d + 16), b);
            _mm_stream_si128((__m128i *)(d + 32), c); _mm_stream_si128((__m128i *)(d + 48), e);
            d += 64; s += 64; n -= 64;
        }
        while (n >= 16) {
            _mm_stream_si128((__m128i *)d, _mm_loadu_si128((const __m128i *)s));
            d += 16; s += 16; n -= 16;
        }
        memcpy(d, s, n);
    }
    /* Streaming stores are weakly ordered: fence them before the window's counters say the bytes are there. */
    static inline void ltp_stream_fence(void) { _mm_sfence(); }
    #else
    #define LTP_HAVE_STREAM 0
    static inline void ltp_stream_copy(uint8_t *d, const uint8_t *s, size_t n) { memcpy(d, s, n); }
    static inline void ltp_stream_fence(void) { }
    #endif
    """
    int LTP_HAVE_STREAM
    void ltp_stream_copy(uint8_t *d, const uint8_t *s, size_t n) noexcept nogil
    void ltp_stream_fence() noexcept nogil

#: True where large receive windows copy with streaming stores (x86-64); the twin always copies plainly
STREAMING_STORES = bool(LTP_HAVE_STREAM)
cdef int64_t _STREAM_MIN = STREAM_COPY_MIN

cdef enum:
    _PENDING = 0
    _INFLIGHT = 1
    _ACKED = 2
    _LOST = 3
    _HDR = 16
    _T_DATA = 1
    _DATA_B0 = 0x11          # version 1, type DATA
    _F_CRITICAL = 0x01
    _F_UNKNOWN = 0xF8        # flag bits that must be zero
    _NOGIL_MIN = 8           # ingest runs at least this long release the GIL

cdef int64_t _I64_MAX = 0x7FFFFFFFFFFFFFFF
cdef int64_t _I32_MAX = 0x7FFFFFFF


# ---------------------------------------------------------------- helpers

cdef inline uint32_t _ld32(const uint8_t *p) noexcept nogil:
    return (<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | p[3]


cdef inline void _st32(uint8_t *p, uint32_t v) noexcept nogil:
    p[0] = <uint8_t>(v >> 24)
    p[1] = <uint8_t>(v >> 16)
    p[2] = <uint8_t>(v >> 8)
    p[3] = <uint8_t>v


cdef inline bint _is_vec(object a, int typenum):
    """True for a 1-D, aligned, native-order ndarray of ``typenum``."""
    if not cnp.PyArray_Check(a):
        return False
    cdef cnp.ndarray arr = <cnp.ndarray>a
    return (cnp.PyArray_TYPE(arr) == typenum and cnp.PyArray_NDIM(arr) == 1
            and cnp.PyArray_ISALIGNED(arr) and cnp.PyArray_ISNOTSWAPPED(arr))


cdef inline object _new_vec(Py_ssize_t n, int typenum, const void *src, size_t itemsize):
    """A new 1-D array of ``n`` items copied from ``src``."""
    cdef cnp.npy_intp dims[1]
    dims[0] = n
    cdef object out = cnp.PyArray_SimpleNew(1, dims, typenum)
    if n:
        memcpy(cnp.PyArray_DATA(<cnp.ndarray>out), src, <size_t>n * itemsize)
    return out


cdef inline void *_ptr(object a):
    return cnp.PyArray_DATA(<cnp.ndarray>a)


cdef int64_t _u_in(object v, int64_t hi) except -2:
    """``v`` as an integer in ``0..hi`` or -1 if it is not one (the twin would then fail or never match)."""
    try:
        x = PyNumber_Index(v)
    except TypeError:
        return -1
    if x < 0 or x > hi:
        return -1
    return <int64_t>x


def _as_bytes_view(buf, writable):
    """Same as the twin's helper: a 1-D byte memoryview over ``buf`` with the twin's error messages."""
    try:
        mv = memoryview(buf)
    except TypeError:
        raise LocalProtocolError("buffer must support the buffer protocol (bytes, bytearray, numpy array)") from None
    if not mv.c_contiguous:
        raise LocalProtocolError("buffer must be C-contiguous; pass numpy.ascontiguousarray(x)")
    if writable and mv.readonly:
        raise LocalProtocolError("receive buffer is read-only; pass a bytearray or a writable numpy array")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


cdef void *_export(object mv, Py_buffer *view, int flags) except NULL:
    """Fill ``view`` with a long-lived export and return ``mv``'s first byte.

    The export is taken from the object *underneath* the memoryview (the
    bytearray or numpy array), not from the memoryview: CPython 3.11's
    memoryview ``tp_clear`` drops its managed buffer even while exported, so a
    memoryview that the garbage collector clears under a live export crashes
    the process when the export is released (seen at interpreter shutdown).
    Falls back to exporting from the memoryview when the base cannot export
    a simple contiguous buffer covering it.
    """
    cdef Py_buffer tmp
    cdef char *p
    cdef char *lo
    base = mv.obj
    PyObject_GetBuffer(mv, &tmp, flags)
    p = <char *>tmp.buf
    PyBuffer_Release(&tmp)
    if base is not None and not isinstance(base, memoryview):
        try:
            PyObject_GetBuffer(base, view, flags)
        except (BufferError, TypeError, ValueError):
            pass
        else:
            lo = <char *>view.buf
            if lo <= p and p + len(mv) <= lo + view.len:
                return p
            PyBuffer_Release(view)
    PyObject_GetBuffer(mv, view, flags)
    return view.buf


cdef object _i64_vec(object a):
    """``a`` itself when it is a fast int64 vector, else ``a`` converted (like ``int(a[k])``)."""
    if _is_vec(a, cnp.NPY_INT64):
        return a
    out = np.asarray(a, dtype=np.int64)
    if out.ndim != 1:
        raise LocalProtocolError("offsets and lengths must be 1-D integer arrays")
    return out


ctypedef struct _AckAcc:
    double now
    double rtt
    int64_t newly
    int64_t newly_bytes
    int64_t best_idx
    int64_t best_seq


# ---------------------------------------------------------------- sender

cdef class SendWindow:
    """Sender-side per-segment state, packet building, ACK processing and loss detection.

    A transmission's send time and delivery-rate snapshot are the same for every packet of one
    :meth:`build` call, so they are kept once per call (a *batch*: a table that starts at
    :data:`~ltp_ext.constants.SEND_BATCH_MIN` entries and doubles) and each
    segment holds the batch of its latest transmission (``tx_batch``) and of its first
    (``first_batch``): 8 bytes per segment instead of 40, which a bulk send writes into fresh pages
    (the kernel zeroes each on first touch) and every ACK reads. Batch 0 is "never sent" (all zero).
    The send log and ``tx_index`` (1 + a segment's latest send index, 0: never) are int32 for the same
    reason. ``sent_time``, ``first_tx_time``, ``sent_idx`` and the ``snap_*`` arrays are per-segment views
    built on demand.
    """

    cdef readonly object data, critical, state, attempt, tx_batch, first_batch, tx_index, log_seq, log_acked, log_lane
    cdef readonly object reorder_verdict
    cdef readonly object flow_id, token, flags
    cdef readonly int64_t total, seg_size, seg_count, last_len
    cdef readonly int64_t log_base, head, tail, acked_in_window
    cdef readonly int64_t acked_count, acked_bytes, inflight_count, inflight_bytes
    cdef readonly int64_t packets_sent, retransmits, lost_events, bad_acks, dup_acks, spurious_losses
    cdef readonly int64_t spurious_reorder_losses
    cdef uint8_t *_reo               # per segment: its latest loss verdict came from a reordering rule (not expiry)
    cdef int _reorder_threshold      # the packet-count loss rule's threshold (0: off; reorder_threshold)

    cdef object _data_ref            # keeps the Py_buffer export of ``data`` alive
    cdef Py_buffer _data_view
    cdef bint _have_view
    cdef object _lost_buf
    cdef const uint8_t *_data
    cdef uint8_t *_crit
    cdef uint8_t *_state
    cdef uint8_t *_attempt
    cdef int32_t *_txb
    cdef int32_t *_fb
    cdef int32_t *_txi               # per segment: 1 + the send index of its latest transmission (0: never)
    cdef object _b_time_arr, _b_d_arr, _b_dt_arr, _b_fs_arr
    cdef double *_b_time             # per batch: send time
    cdef int64_t *_b_d               # per batch: the path's delivered bytes at send (rate sample snapshot)
    cdef double *_b_dt               # per batch: its delivered time
    cdef double *_b_fs               # per batch: its first-sent time
    cdef int64_t _nb, _b_cap         # batches used (batch 0 included), capacity
    cdef int32_t *_log_seq
    cdef uint8_t *_log_acked
    cdef uint8_t *_log_lane          # per send-log entry: the lane (part of its batch) it was sent in
    cdef int64_t _lane_acked[_MAX_LANES]  # per lane: acknowledged entries from head on (acked_in_window, split)
    cdef int64_t *_lost
    cdef int64_t _log_cap
    cdef bint _hdr_fast              # flow id, token and flags fit the header fields
    cdef uint8_t _hdr[2][8]          # header bytes 0..7 without / with F_CRITICAL

    def __cinit__(self, data, total, seg_size, flow_id, token, flags, critical):
        mv = _as_bytes_view(data, False)
        self._reorder_threshold = _REORDER
        self.data = mv
        if total > len(mv) or total <= 0 or seg_size <= 0:
            raise LocalProtocolError("total must be in 1..len(data) and seg_size positive")
        n = (total + seg_size - 1) // seg_size
        self.total = total
        self.seg_size = seg_size
        self.seg_count = n
        self.last_len = total - (n - 1) * seg_size
        self.flow_id = flow_id
        self.token = token
        self.flags = flags
        crit = np.ascontiguousarray(critical, dtype=np.uint8)
        if crit.ndim != 1 or crit.shape[0] != n:
            raise LocalProtocolError("critical mask must have one entry per segment")
        self.critical = crit
        if n > _I32_MAX:
            raise LocalProtocolError("too many segments for one message")
        self.state = np.zeros(n, np.uint8)
        self.attempt = np.zeros(n, np.uint8)
        self.tx_batch = np.zeros(n, np.int32)
        self.first_batch = np.zeros(n, np.int32)  # attempt 1's batch: its send time (see _ack_one)
        self.reorder_verdict = np.zeros(n, np.uint8)
        self.tx_index = np.zeros(n, np.int32)
        self._b_cap = 0
        self._nb = 0
        self._batch_grow()
        self._nb = 1  # batch 0: never sent
        cap = max(64, n + n // 4)
        self.log_seq = np.empty(cap, np.int32)
        self.log_acked = np.zeros(cap, np.uint8)
        self.log_lane = np.zeros(cap, np.uint8)
        memset(self._lane_acked, 0, sizeof(self._lane_acked))
        self._lost_buf = np.empty(n, np.int64)
        self._data = <const uint8_t *>_export(mv, &self._data_view, PyBUF_SIMPLE)
        self._have_view = True
        self._data_ref = mv
        self._crit = <uint8_t *>_ptr(crit)
        self._state = <uint8_t *>_ptr(self.state)
        self._attempt = <uint8_t *>_ptr(self.attempt)
        self._txb = <int32_t *>_ptr(self.tx_batch)
        self._fb = <int32_t *>_ptr(self.first_batch)
        self._reo = <uint8_t *>_ptr(self.reorder_verdict)
        self._txi = <int32_t *>_ptr(self.tx_index)
        self._log_seq = <int32_t *>_ptr(self.log_seq)
        self._log_acked = <uint8_t *>_ptr(self.log_acked)
        self._log_lane = <uint8_t *>_ptr(self.log_lane)
        self._lost = <int64_t *>_ptr(self._lost_buf)
        self._log_cap = cap
        cdef int64_t fid = _u_in(flow_id, 0xFFFF)
        cdef int64_t tok = _u_in(token, 0xFFFFFFFF)
        cdef int64_t fl = _u_in(flags, 0xFF)
        self._hdr_fast = fid >= 0 and tok >= 0 and fl >= 0
        cdef int c
        if self._hdr_fast:
            for c in range(2):
                self._hdr[c][0] = _DATA_B0
                self._hdr[c][1] = <uint8_t>(fl | (_F_CRITICAL if c else 0))
                self._hdr[c][2] = <uint8_t>(fid >> 8)
                self._hdr[c][3] = <uint8_t>fid
                _st32(&self._hdr[c][4], <uint32_t>tok)

    def __dealloc__(self):
        if self._have_view:
            PyBuffer_Release(&self._data_view)
            self._have_view = False

    def seg_len(self, seq):
        """Payload bytes of segment ``seq``."""
        return self.last_len if seq == self.seg_count - 1 else self.seg_size

    cdef inline int64_t _len(self, int64_t seq) noexcept nogil:
        return self.last_len if seq == self.seg_count - 1 else self.seg_size

    # -- batches -----------------------------------------------------------------
    cdef int _batch_grow(self) except -1:
        cdef int64_t cap = max(SEND_BATCH_MIN, self._b_cap * 2), nb = self._nb
        if cap > _I32_MAX:
            raise LocalProtocolError("too many send batches for one message")
        arrs = (np.zeros(cap, np.float64), np.zeros(cap, np.int64), np.zeros(cap, np.float64),
                np.zeros(cap, np.float64))
        if nb:
            memcpy(_ptr(arrs[0]), self._b_time, <size_t>nb * sizeof(double))
            memcpy(_ptr(arrs[1]), self._b_d, <size_t>nb * sizeof(int64_t))
            memcpy(_ptr(arrs[2]), self._b_dt, <size_t>nb * sizeof(double))
            memcpy(_ptr(arrs[3]), self._b_fs, <size_t>nb * sizeof(double))
        self._b_time_arr, self._b_d_arr, self._b_dt_arr, self._b_fs_arr = arrs
        self._b_time = <double *>_ptr(arrs[0])
        self._b_d = <int64_t *>_ptr(arrs[1])
        self._b_dt = <double *>_ptr(arrs[2])
        self._b_fs = <double *>_ptr(arrs[3])
        self._b_cap = cap
        return 0

    cdef int32_t _batch_open(self, double now, int64_t delivered, double delivered_time,
                             double first_sent_time) except -1:
        if self._nb >= self._b_cap:
            self._batch_grow()
        cdef int64_t b = self._nb
        self._b_time[b] = now
        self._b_d[b] = delivered
        self._b_dt[b] = delivered_time
        self._b_fs[b] = first_sent_time
        self._nb = b + 1
        return <int32_t>b

    @property
    def batches(self):
        """Batches used, batch 0 (never sent) included."""
        return self._nb

    @property
    def reorder_threshold(self):
        """How many later transmissions of its lane must be acknowledged before :meth:`on_ack` declares one lost
        (``PACKET_REORDER_THRESHOLD`` by default); 0 turns that rule off, leaving the RACK time rule
        (:meth:`detect_reordered`) and the tail-loss timer (:meth:`expire`): the sender sets it per path, and turns
        it off where the path proved to reorder (``ltp.reordering``)."""
        return self._reorder_threshold

    @reorder_threshold.setter
    def reorder_threshold(self, value):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _I32_MAX:
            raise LocalProtocolError(f"reorder_threshold must be an int in 0..{_I32_MAX} (0: off), got {value!r}")
        self._reorder_threshold = value

    @property
    def sent_idx(self):
        """Per segment: the send index of its latest transmission (-1: never sent)."""
        return self.tx_index.astype(np.int64) - 1

    @property
    def sent_time(self):
        """Per segment: when its latest transmission left (0.0: never sent)."""
        return self._b_time_arr[self.tx_batch]

    @property
    def first_tx_time(self):
        """Per segment: when its first transmission left (0.0: never sent)."""
        return self._b_time_arr[self.first_batch]

    @property
    def snap_delivered(self):
        """Per segment: the path's delivered bytes when its latest transmission left."""
        return self._b_d_arr[self.tx_batch]

    @property
    def snap_delivered_time(self):
        """Per segment: the path's delivered time when its latest transmission left."""
        return self._b_dt_arr[self.tx_batch]

    @property
    def snap_first_sent(self):
        """Per segment: the path's first-sent time when its latest transmission left."""
        return self._b_fs_arr[self.tx_batch]

    # -- send log --------------------------------------------------------------
    cdef int _log_grow(self) except -1:
        cdef int64_t keep = self.tail - self.head
        cdef int64_t start = self.head - self.log_base
        cdef int64_t cap = self._log_cap
        if keep * 2 > cap:
            new_seq = np.empty(cap * 2, np.int32)
            new_acked = np.zeros(cap * 2, np.uint8)
            new_lane = np.zeros(cap * 2, np.uint8)
            memcpy(_ptr(new_seq), self._log_seq + start, <size_t>keep * sizeof(int32_t))
            memcpy(_ptr(new_acked), self._log_acked + start, <size_t>keep)
            memcpy(_ptr(new_lane), self._log_lane + start, <size_t>keep)
            self.log_seq = new_seq
            self.log_acked = new_acked
            self.log_lane = new_lane
            self._log_seq = <int32_t *>_ptr(new_seq)
            self._log_acked = <uint8_t *>_ptr(new_acked)
            self._log_lane = <uint8_t *>_ptr(new_lane)
            self._log_cap = cap * 2
        else:
            memmove(self._log_seq, self._log_seq + start, <size_t>keep * sizeof(int32_t))
            memmove(self._log_acked, self._log_acked + start, <size_t>keep)
            memmove(self._log_lane, self._log_lane + start, <size_t>keep)
            memset(self._log_acked + keep, 0, <size_t>(cap - keep))
        self.log_base = self.head
        return 0

    cdef inline int64_t _log_append(self, int64_t seq, uint8_t lane) except -1:
        if self.tail >= _I32_MAX - 1:
            raise LocalProtocolError("too many transmissions for one message")
        cdef int64_t pos = self.tail - self.log_base
        if pos >= self._log_cap:
            self._log_grow()
            pos = self.tail - self.log_base
        self._log_seq[pos] = <int32_t>seq
        self._log_acked[pos] = 0
        self._log_lane[pos] = lane
        cdef int64_t idx = self.tail
        self.tail += 1
        return idx

    # -- building --------------------------------------------------------------
    cdef int64_t _build_one(self, int64_t seq, int64_t k, uint8_t *buf, Py_ssize_t buflen, int32_t batch,
                            int64_t est, object est_obj, object out_obj, bint headers_only, uint8_t lane) except -1:
        cdef uint8_t a = <uint8_t>(self._attempt[seq] + 1)
        self._attempt[seq] = a
        cdef uint8_t st = self._state[seq]
        cdef int64_t length = self._len(seq)
        if st != _PENDING:
            self.retransmits += 1
        else:
            self._fb[seq] = batch
        if st == _INFLIGHT:
            self.inflight_count -= 1
            self.inflight_bytes -= length + _HDR
        cdef int64_t end = k * (_HDR + self.seg_size) + _HDR + length
        cdef int64_t off = k * _HDR if headers_only else k * (_HDR + self.seg_size)
        cdef int c = self._crit[seq] != 0
        cdef int64_t word2 = (seq << 8) | a
        cdef uint8_t *p
        if not self._hdr_fast or est < 0 or word2 > 0xFFFFFFFF or off + _HDR > buflen:
            # the twin's own packer raises the twin's exact struct.error
            _py_pack_header_into(out_obj, off, _T_DATA, self.flags | (_F_CRITICAL if c else 0),
                                 self.flow_id, self.token, word2, est_obj)
        else:
            p = buf + off
            memcpy(p, &self._hdr[c][0], 8)
            _st32(p + 8, <uint32_t>word2)
            _st32(p + 12, <uint32_t>est)
        if not headers_only:
            if off + _HDR + length > buflen:
                raise ValueError("memoryview assignment: lvalue and rvalue have different structures")
            memcpy(buf + off + _HDR, self._data + seq * self.seg_size, <size_t>length)
        self._state[seq] = _INFLIGHT
        self.inflight_count += 1
        self.inflight_bytes += length + _HDR
        self._txb[seq] = batch
        self._txi[seq] = <int32_t>(self._log_append(seq, lane) + 1)
        self.packets_sent += 1
        return end

    def build(self, seqs, double now, int64_t delivered, double delivered_time, double first_sent_time,
              est_word, out, bint headers_only=False, lanes=1):
        """Write DATA packets for ``seqs`` into ``out`` at a stride of ``16 + seg_size``.

        Only the last packet may be short (the caller puts the final segment
        last). Returns the number of wire bytes of the packets built.  With
        ``headers_only`` only the 16-byte headers are written, packed at a
        stride of 16 (the payload stays in the message, for a gather send).

        ``lanes`` (1..``SEND_THREADS_MAX``): the batch goes out as that many
        contiguous parts that may interleave on the wire (part ``k``: packets
        ``m*k//lanes`` to ``m*(k+1)//lanes`` of ``m``; ``UdpIO.send_segments(parts=)``).
        Loss detection then counts, for a transmission, only the later ones of
        its own lane: each part keeps its order, the parts do not.
        """
        if not isinstance(lanes, int) or isinstance(lanes, bool) or not 1 <= lanes <= _MAX_LANES:
            raise LocalProtocolError(f"lanes must be 1..{_MAX_LANES}, got {lanes!r}")
        cdef int64_t nl = lanes
        cdef Py_buffer view
        cdef object out_obj = out
        if PyByteArray_CheckExact(out):
            PyObject_GetBuffer(out, &view, PyBUF_WRITABLE)
        else:
            out_obj = _as_bytes_view(out, True)
            PyObject_GetBuffer(out_obj, &view, PyBUF_WRITABLE)
        cdef int64_t est = _u_in(est_word, 0xFFFFFFFF)
        cdef int64_t written = 0, k, m, seq, n = self.seg_count
        cdef const char *sp
        cdef Py_ssize_t sstride
        cdef uint8_t *buf = <uint8_t *>view.buf
        cdef Py_ssize_t buflen = view.len
        cdef int32_t batch = 0
        cdef int64_t cut
        cdef uint8_t lane = 0
        try:
            if len(seqs):
                batch = self._batch_open(now, delivered, delivered_time, first_sent_time)
            if _is_vec(seqs, cnp.NPY_INT64):
                sp = <const char *>cnp.PyArray_DATA(<cnp.ndarray>seqs)
                sstride = cnp.PyArray_STRIDE(<cnp.ndarray>seqs, 0)
                m = cnp.PyArray_DIM(<cnp.ndarray>seqs, 0)
                cut = m // nl
                for k in range(m):
                    while k >= cut:
                        lane += 1
                        cut = m * (lane + 1) // nl
                    seq = (<const int64_t *>(sp + k * sstride))[0]
                    if seq < 0 or seq >= n:
                        raise LocalProtocolError(f"segment {seq} out of range")
                    written = self._build_one(seq, k, buf, buflen, batch, est, est_word, out_obj, headers_only,
                                              lane)
            else:
                m = len(seqs)
                cut = m // nl
                for k in range(m):
                    while k >= cut:
                        lane += 1
                        cut = m * (lane + 1) // nl
                    s = int(seqs[k])
                    if s < 0 or s >= n:
                        raise LocalProtocolError(f"segment {s} out of range")
                    written = self._build_one(<int64_t>s, k, buf, buflen, batch, est, est_word, out_obj,
                                              headers_only, lane)
        finally:
            PyBuffer_Release(&view)
        return written

    # -- ACKs and loss -----------------------------------------------------------
    cdef inline void _ack_one(self, int64_t e, _AckAcc *acc) noexcept nogil:
        cdef int64_t seq = e >> 8
        cdef uint8_t a = <uint8_t>(e & 0xFF)
        cdef int64_t wire, idx
        cdef double r
        if seq >= self.seg_count or e < 0:
            self.bad_acks += 1
            return
        cdef uint8_t st = self._state[seq]
        if st == _ACKED:
            self.dup_acks += 1
            return
        if st == _PENDING:
            self.bad_acks += 1
            return
        if st == _LOST or a != self._attempt[seq]:
            # a transmission this window had declared lost arrived after all (its resend is not built yet, or an
            # older attempt is acknowledged after the resend left): the verdict was wrong
            self.spurious_losses += 1
            self.spurious_reorder_losses += self._reo[seq]
        wire = self._len(seq) + _HDR
        if st == _INFLIGHT:
            self.inflight_count -= 1
            self.inflight_bytes -= wire
        if a == self._attempt[seq]:
            r = acc.now - self._b_time[self._txb[seq]]
            if acc.rtt < 0.0 or r < acc.rtt:
                acc.rtt = r
            idx = self._txi[seq] - 1
            if idx >= self.head:
                self._log_acked[idx - self.log_base] = 1
                self.acked_in_window += 1
                self._lane_acked[self._log_lane[idx - self.log_base]] += 1
            if idx > acc.best_idx:
                acc.best_idx = idx
                acc.best_seq = seq
        elif a == 1:
            # the first transmission, acknowledged after the segment was sent again (a probe timeout that fired
            # before the path's first RTT was known): its send time is kept, so the RTT is exact
            r = acc.now - self._b_time[self._fb[seq]]
            if acc.rtt < 0.0 or r < acc.rtt:
                acc.rtt = r
        self._state[seq] = _ACKED
        self.acked_count += 1
        self.acked_bytes += wire - _HDR
        acc.newly += 1
        acc.newly_bytes += wire

    def on_ack(self, entries, now, delivered, delivered_time):
        """Process ACK entries (``seq << 8 | attempt``).

        Returns ``(newly_acked, newly_acked_bytes, delivered, delivered_time,
        rtt, prior_delivered, prior_time, first_sent, sample_sent, lost)``:
        ``rtt`` is the smallest RTT sample (-1.0 if none), the ``prior_*``,
        ``first_sent`` and ``sample_sent`` describe the most recently sent
        newly acknowledged transmission (``prior_delivered`` = -1 if none) and
        ``lost`` is an int64 array of segments newly declared lost.
        """
        cdef _AckAcc acc
        acc.now = now
        acc.rtt = -1.0
        acc.newly = 0
        acc.newly_bytes = 0
        acc.best_idx = -1
        acc.best_seq = -1
        cdef const char *ep
        cdef Py_ssize_t estride, k, m
        if _is_vec(entries, cnp.NPY_UINT32):
            ep = <const char *>cnp.PyArray_DATA(<cnp.ndarray>entries)
            estride = cnp.PyArray_STRIDE(<cnp.ndarray>entries, 0)
            m = cnp.PyArray_DIM(<cnp.ndarray>entries, 0)
            for k in range(m):
                self._ack_one((<const uint32_t *>(ep + k * estride))[0], &acc)
        else:
            m = len(entries)
            for k in range(m):
                e = int(entries[k])
                if e > _I64_MAX:
                    self.bad_acks += 1       # seq >= 2**55 > seg_count, as in the twin
                else:
                    self._ack_one(<int64_t>e, &acc)   # negative: bad_acks (see module docstring)
        if acc.newly:
            delivered = delivered + acc.newly_bytes
            delivered_time = now
        cdef int64_t b = acc.best_seq
        if b >= 0:
            b = self._txb[b]
            prior = (self._b_d[b], self._b_dt[b], self._b_fs[b], self._b_time[b])
        else:
            prior = (-1, 0.0, 0.0, 0.0)
        lost = self._detect(self._reorder_threshold, -1.0) if self._reorder_threshold else \
            _new_vec(0, cnp.NPY_INT64, self._lost, sizeof(int64_t))
        return (acc.newly, acc.newly_bytes, delivered, delivered_time, acc.rtt) + prior + (lost,)

    def expire(self, double cutoff):
        """Declare lost every in-flight transmission sent at or before ``cutoff`` (tail-loss timer)."""
        return self._detect(0, cutoff)

    def detect_reordered(self, double cutoff):
        """Declare lost every in-flight transmission sent at or before ``cutoff`` that a later transmission
        overtook: one sent after it was acknowledged (the RACK time threshold, RFC 8985)."""
        return self._detect(-1, cutoff)

    cdef object _detect(self, int threshold, double cutoff):
        cdef int64_t cnt = 0, i, seq, later
        while self.head < self.tail:
            i = self.head - self.log_base
            seq = self._log_seq[i]
            if self._log_acked[i]:
                self.acked_in_window -= 1
                self._lane_acked[self._log_lane[i]] -= 1
                self.head += 1
                continue
            if self._txi[seq] != self.head + 1 or self._state[seq] != _INFLIGHT:
                self.head += 1
                continue
            later = self._lane_acked[self._log_lane[i]]  # acknowledged transmissions after it, in its lane
            if ((threshold > 0 and later >= threshold)
                    or (threshold == 0 and self._b_time[self._txb[seq]] <= cutoff)
                    or (threshold < 0 and later > 0 and self._b_time[self._txb[seq]] <= cutoff)):
                self._state[seq] = _LOST
                self._reo[seq] = threshold != 0
                self.inflight_count -= 1
                self.inflight_bytes -= self._len(seq) + _HDR
                self.lost_events += 1
                self._lost[cnt] = seq
                cnt += 1
                self.head += 1
                continue
            break
        return _new_vec(cnt, cnp.NPY_INT64, self._lost, sizeof(int64_t))

    def oldest_inflight_time(self):
        """Send time of the oldest unresolved in-flight transmission, or -1.0."""
        return self._oldest(False)

    def rack_candidate_time(self):
        """Send time of the oldest unresolved in-flight transmission if a later one of its lane was acknowledged
        (what :meth:`detect_reordered` would declare lost once its cutoff passes that time), else -1.0."""
        return self._oldest(True)

    cdef double _oldest(self, bint overtaken):
        cdef int64_t h = self.head, i, seq
        while h < self.tail:
            i = h - self.log_base
            seq = self._log_seq[i]
            if not self._log_acked[i] and self._txi[seq] == h + 1 and self._state[seq] == _INFLIGHT:
                if overtaken and self._lane_acked[self._log_lane[i]] <= 0:
                    return -1.0
                return self._b_time[self._txb[seq]]
            h += 1
        return -1.0


# ---------------------------------------------------------------- receiver

cdef class RecvWindow:
    """Receiver-side per-flow state: validation, in-place reassembly, bitmap and ACK entries."""

    # attributes and the C-level _run are declared in _datapath.pxd (ltp_ext._udpio cimports them)

    def __cinit__(self, dest, total, seg_size, flow_id, token, critical, ack_capacity=4096):
        mv = _as_bytes_view(dest, True)
        self.dest = mv
        if total > len(mv) or total <= 0 or seg_size <= 0:
            raise LocalProtocolError("total must be in 1..len(dest) and seg_size positive")
        n = (total + seg_size - 1) // seg_size
        self.total = total
        self.seg_size = seg_size
        self.seg_count = n
        self.last_len = total - (n - 1) * seg_size
        self.flow_id = flow_id
        self.token = token
        self.bitmap = np.zeros(n, np.uint8)
        if critical is None:
            crit = np.zeros(n, np.uint8)
        else:
            crit = np.ascontiguousarray(critical, dtype=np.uint8)
            if crit.ndim != 1 or crit.shape[0] != n:
                raise LocalProtocolError("critical mask must have one entry per segment")
        self.critical = crit
        self.critical_total = int(np.count_nonzero(crit))
        self.acks = np.empty(ack_capacity, np.uint32)
        self._dest = <uint8_t *>_export(mv, &self._dest_view, PyBUF_SIMPLE | PyBUF_WRITABLE)
        self._have_view = True
        self._bitmap = <uint8_t *>_ptr(self.bitmap)
        self._crit = <uint8_t *>_ptr(crit)
        self._acks = <uint32_t *>_ptr(self.acks)
        self._cap = self.acks.shape[0]
        self._stream = LTP_HAVE_STREAM and total >= _STREAM_MIN
        cdef int64_t fid = -1, tok = -1
        try:   # the twin compares with ==, so 7.0 matches flow 7 and 7.5 matches nothing
            if flow_id == int(flow_id):
                fid = _u_in(int(flow_id), 0xFFFF)
            if token == int(token):
                tok = _u_in(int(token), 0xFFFFFFFF)
        except (TypeError, ValueError, OverflowError):
            pass
        self._never = fid < 0 or tok < 0
        cdef uint8_t m[8]
        cdef uint8_t x[8]
        if not self._never:
            x[0] = _DATA_B0
            x[1] = 0
            x[2] = <uint8_t>(fid >> 8)
            x[3] = <uint8_t>fid
            _st32(&x[4], <uint32_t>tok)
            memset(m, 0xFF, 8)
            m[1] = _F_UNKNOWN
            memcpy(&self._match, x, 8)
            memcpy(&self._mask, m, 8)

    def __dealloc__(self):
        if self._have_view:
            PyBuffer_Release(&self._dest_view)
            self._have_view = False

    cdef Py_ssize_t _run(self, const uint8_t *b, Py_ssize_t blen, const char *op, Py_ssize_t ostride,
                         const char *lp, Py_ssize_t lstride, Py_ssize_t i, Py_ssize_t lim,
                         int *err) noexcept nogil:
        """Consume datagrams ``i..lim``; return the first not consumed (``err`` set: outside ``b``)."""
        cdef int64_t n = self.seg_count, seg = self.seg_size, last = self.last_len, cap = self._cap
        cdef int64_t n_acks = self.n_acks, received = self.received, rbytes = self.received_bytes
        cdef int64_t dups = self.duplicates, bad_seq = self.bad_seq, bad_len = self.bad_length
        cdef int64_t crit_rx = self.critical_received, word3 = self.last_word3
        cdef uint64_t match = self._match, mask = self._mask, h
        cdef uint8_t *dest = self._dest
        cdef uint8_t *bitmap = self._bitmap
        cdef const uint8_t *crit = self._crit
        cdef uint32_t *acks = self._acks
        cdef bint never = self._never, stream = self._stream
        cdef int64_t copied = 0
        cdef int64_t o, length, plen, seq
        cdef uint32_t w2
        cdef const uint8_t *p
        while i < lim:
            o = (<const int64_t *>(op + i * ostride))[0]
            length = (<const int64_t *>(lp + i * lstride))[0]
            if length < _HDR:
                break
            if o < 0 or o > blen - length:
                err[0] = 1
                break
            p = b + o
            memcpy(&h, p, 8)
            if never or (h & mask) != match:
                break
            w2 = _ld32(p + 8)
            seq = w2 >> 8
            i += 1
            if seq >= n:
                bad_seq += 1
                continue
            plen = length - _HDR
            if plen != (last if seq == n - 1 else seg):
                bad_len += 1
                continue
            if n_acks >= cap:
                i -= 1
                break
            acks[n_acks] = w2
            n_acks += 1
            word3 = _ld32(p + 12)
            if bitmap[seq]:
                dups += 1
                continue
            if stream:
                ltp_stream_copy(dest + seq * seg, p + _HDR, <size_t>plen)
                copied += 1
            else:
                memcpy(dest + seq * seg, p + _HDR, <size_t>plen)
            bitmap[seq] = 1
            received += 1
            rbytes += plen
            if crit[seq]:
                crit_rx += 1
        if copied:
            ltp_stream_fence()
        self.n_acks = n_acks
        self.received = received
        self.received_bytes = rbytes
        self.duplicates = dups
        self.bad_seq = bad_seq
        self.bad_length = bad_len
        self.critical_received = crit_rx
        self.last_word3 = word3
        return i

    def ingest(self, buf, offsets, lengths, Py_ssize_t start, Py_ssize_t stop):
        """Consume DATA datagrams of this flow from index ``start``; return the first index not consumed."""
        cdef Py_buffer view
        cdef object keep = buf
        try:
            PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
        except BufferError:            # not contiguous: read a copy (the twin indexes the view)
            keep = memoryview(buf).tobytes()
            PyObject_GetBuffer(keep, &view, PyBUF_SIMPLE)
        cdef Py_ssize_t lim, j
        cdef int err = 0
        try:
            if start >= stop:
                return stop
            if start < 0:
                raise LocalProtocolError("start must be non-negative")
            off = _i64_vec(offsets)
            lens = _i64_vec(lengths)
            n_off = cnp.PyArray_DIM(<cnp.ndarray>off, 0)
            n_len = cnp.PyArray_DIM(<cnp.ndarray>lens, 0)
            lim = min(stop, n_off, n_len)
            if lim < start:
                lim = start
            if lim - start >= _NOGIL_MIN:
                with nogil:
                    j = self._run(<const uint8_t *>view.buf, view.len,
                                  <const char *>cnp.PyArray_DATA(<cnp.ndarray>off),
                                  cnp.PyArray_STRIDE(<cnp.ndarray>off, 0),
                                  <const char *>cnp.PyArray_DATA(<cnp.ndarray>lens),
                                  cnp.PyArray_STRIDE(<cnp.ndarray>lens, 0), start, lim, &err)
            else:
                j = self._run(<const uint8_t *>view.buf, view.len,
                              <const char *>cnp.PyArray_DATA(<cnp.ndarray>off),
                              cnp.PyArray_STRIDE(<cnp.ndarray>off, 0),
                              <const char *>cnp.PyArray_DATA(<cnp.ndarray>lens),
                              cnp.PyArray_STRIDE(<cnp.ndarray>lens, 0), start, lim, &err)
            if err:
                raise LocalProtocolError(
                    f"datagram {j} (offset {off[j]}, length {lens[j]}) lies outside the buffer of {view.len} bytes")
            if j == lim and lim < stop:
                size = n_off if n_off <= lim else n_len
                raise IndexError(f"index {lim} is out of bounds for axis 0 with size {size}")
            return j
        finally:
            PyBuffer_Release(&view)

    def take_acks(self):
        """Return and clear the queued ACK entries."""
        out = _new_vec(self.n_acks, cnp.NPY_UINT32, self._acks, sizeof(uint32_t))
        self.n_acks = 0
        return out

    def missing_runs(self):
        """Half-open segment ranges that have not arrived, in order."""
        cdef int64_t s = 0, a, n = self.seg_count
        cdef const uint8_t *bm = self._bitmap
        runs = []
        while s < n:
            if bm[s]:
                s += 1
                continue
            a = s
            while s < n and not bm[s]:
                s += 1
            runs.append((a, s))
        return runs

    def zero_fill_missing(self):
        """Write zeros over every missing segment (packet bubbles); return bytes zeroed."""
        cdef int64_t s = 0, a, lo, hi, zeroed = 0
        cdef int64_t n = self.seg_count, seg = self.seg_size, total = self.total
        cdef const uint8_t *bm = self._bitmap
        cdef uint8_t *dest = self._dest
        with nogil:
            while s < n:
                if bm[s]:
                    s += 1
                    continue
                a = s
                while s < n and not bm[s]:
                    s += 1
                lo = a * seg
                hi = s * seg
                if hi > total:
                    hi = total
                memset(dest + lo, 0, <size_t>(hi - lo))
                zeroed += hi - lo
        return zeroed
