# cython: language_level=3
"""C-level declarations of ``ltp_ext._datapath`` that other compiled modules use.

``ltp_ext._udpio`` feeds the datagrams of a bulk receive straight into a
:class:`RecvWindow` (``UdpIO.drain``) through ``RecvWindow._run``, without a
Python call per batch; the attributes are declared here because Cython needs a
class's whole layout where another module cimports it.
"""

from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t


cdef class RecvWindow:
    cdef readonly object dest, bitmap, critical, acks, flow_id, token
    cdef readonly int64_t total, seg_size, seg_count, last_len
    cdef readonly object critical_total
    cdef readonly int64_t critical_received, received, received_bytes, duplicates, bad_seq, bad_length
    cdef readonly int64_t last_word3, n_acks

    cdef Py_buffer _dest_view
    cdef bint _have_view
    cdef uint8_t *_dest
    cdef uint8_t *_bitmap
    cdef uint8_t *_crit
    cdef uint32_t *_acks
    cdef int64_t _cap
    cdef uint64_t _match             # header bytes 0..7 expected (memory order) after masking
    cdef uint64_t _mask
    cdef bint _never                 # flow id / token cannot match any header
    cdef bint _stream                # payloads are copied with streaming stores (STREAM_COPY_MIN)

    cdef Py_ssize_t _run(self, const uint8_t *b, Py_ssize_t blen, const char *op, Py_ssize_t ostride,
                         const char *lp, Py_ssize_t lstride, Py_ssize_t i, Py_ssize_t lim,
                         int *err) noexcept nogil
