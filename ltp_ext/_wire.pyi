"""Type stubs for the compiled ``ltp_ext._wire`` (twin: ``ltp_ext._wire_py``)."""

from collections.abc import Iterable

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer

from .errors import WireError as WireError

VERSION: int
HEADER_SIZE: int
T_REG: int
T_DATA: int
T_ACK: int
T_STOP: int
T_RESET: int
F_CRITICAL: int
F_RELIABLE: int
F_MAC: int
F_KNOWN: int
MAC_SIZE: int
REG_FIXED_SIZE: int
MAX_ACK_ENTRIES: int
MAX_RANGES: int
MAX_SEQ: int

def uf16_encode(value: int) -> int: ...
def uf16_decode(code: int) -> int: ...
def estimates_word(rtprop_us: int, btlbw_bps: int) -> int: ...
def split_estimates(word3: int) -> tuple[int, int]: ...
def pack_header(ptype: int, flags: int, flow_id: int, token: int, word2: int, word3: int) -> bytes: ...
def pack_header_into(
    buf: Buffer, offset: int, ptype: int, flags: int, flow_id: int, token: int, word2: int, word3: int
) -> None: ...
def unpack_header(buf: Buffer, offset: int = 0) -> tuple[int, int, int, int, int, int]: ...
def pack_reg_body(
    total: int,
    segment_size: int,
    element_size: int,
    segment_count: int,
    tag: int,
    mode: int,
    ranges: Iterable[tuple[int, int]],
    timestamp_us: int = 0,
) -> bytes: ...
def unpack_reg_body(
    buf: Buffer, offset: int, has_mac: bool
) -> tuple[int, int, int, int, int, int, list[tuple[int, int]], bytes | None, int, int]: ...
def pack_ack(
    flow_id: int, token: int, received: int, ack_delay_us: int, entries: npt.ArrayLike
) -> bytes: ...
def unpack_ack_entries(buf: Buffer, word3: int, offset: int = 0) -> npt.NDArray[np.uint32]: ...
