"""The LTP wire codec: ``ltp_ext._wire`` when built, else its pure-Python twin.

See docs/protocol.md for the byte layout and ``ltp_ext/_wire_py.py`` for the API.
"""

from ltp_ext import load as _load

from .regimes import CloseReason

_impl = _load("wire")

VERSION = _impl.VERSION
HEADER_SIZE = _impl.HEADER_SIZE
T_REG = _impl.T_REG
T_DATA = _impl.T_DATA
T_ACK = _impl.T_ACK
T_STOP = _impl.T_STOP
T_RESET = _impl.T_RESET
F_CRITICAL = _impl.F_CRITICAL
F_RELIABLE = _impl.F_RELIABLE
F_MAC = _impl.F_MAC
F_GRANT = _impl.F_GRANT
MAC_SIZE = _impl.MAC_SIZE
MAX_ACK_ENTRIES = _impl.MAX_ACK_ENTRIES
MAX_RANGES = _impl.MAX_RANGES
MAX_SEQ = _impl.MAX_SEQ
uf16_encode = _impl.uf16_encode
uf16_decode = _impl.uf16_decode
pack_header = _impl.pack_header
pack_header_into = _impl.pack_header_into
unpack_header = _impl.unpack_header
estimates_word = _impl.estimates_word
split_estimates = _impl.split_estimates
pack_reg_body = _impl.pack_reg_body
unpack_reg_body = _impl.unpack_reg_body
pack_ack = _impl.pack_ack
unpack_ack_entries = _impl.unpack_ack_entries
ack_grant = _impl.ack_grant

#: STOP close reasons (word 3 high byte).
STOP_REASONS = {1: CloseReason.COMPLETE, 2: CloseReason.EARLY, 3: CloseReason.DEADLINE, 4: CloseReason.CANCELLED}
STOP_CODES = {v: k for k, v in STOP_REASONS.items()}
#: RESET reasons (word 2).
RESET_REASONS = {1: "too_large", 2: "too_many_flows", 3: "out_of_memory", 4: "unauthenticated",
                 5: "bad_registration", 6: "cancelled", 7: "shutdown", 8: "stale",
                 9: "unregistered"}
RESET_CODES = {v: k for k, v in RESET_REASONS.items()}
