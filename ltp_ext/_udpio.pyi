"""Type stubs for the compiled ``ltp_ext._udpio`` (twin: ``ltp_ext._udpio_py``)."""

import socket
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt
from typing import Any

from typing_extensions import Buffer

ICMP_ERRNOS: frozenset[int]
GSO_MAX_SEGMENTS: int
GSO_MAX_BYTES: int
MAX_SEGMENT_SIZE: int
GRO_SLOT_SIZE: int
MAX_BATCH: int
SEND_THREADS_MAX: int
SEND_QUEUE_DEPTH: int
SO_TIMESTAMPNS_OPT: int
SO_RXQ_OVFL_OPT: int
IP_RECVERR_OPT: int
IPV6_RECVERR_OPT: int

Address = tuple[str, int] | tuple[str, int, int] | tuple[str, int, int, int]

class UdpIO:
    """Batched, non-blocking UDP I/O on an existing socket (IPv4 and IPv6)."""

    family: int
    batch: int
    max_datagram: int
    gso_enabled: bool
    gro_enabled: bool
    timestamps_enabled: bool
    recverr_enabled: bool
    drops_enabled: bool
    stage_sends: bool
    icmp_errors: int
    socket_drops: int
    send_threads: int
    def __init__(
        self,
        sock: socket.socket,
        *,
        batch: int = 64,
        max_datagram: int = 2048,
        gso: bool = True,
        gro: bool = True,
        timestamps: bool = True,
        recverr: bool = True,
        drops: bool = True,
        send_threads: int = 0,
        stage_sends: bool = True,
    ) -> None: ...
    @property
    def buffer(self) -> memoryview: ...
    @property
    def offsets(self) -> npt.NDArray[np.int64]: ...
    @property
    def lengths(self) -> npt.NDArray[np.int64]: ...
    @property
    def times(self) -> npt.NDArray[np.float64]: ...
    @property
    def stats(self) -> dict[str, int | dict[str, int]]: ...
    @property
    def thread_destinations(self) -> int: ...
    @property
    def thread_destinations_max(self) -> int: ...
    @thread_destinations_max.setter
    def thread_destinations_max(self, value: int) -> None: ...
    def __len__(self) -> int: ...
    def recv_batch(self) -> int: ...
    def recv_errors(self, limit: int = 64) -> list[tuple[Address, int, int, int, int]]: ...
    def addr(self, i: int) -> Address: ...
    def runs(self, start: int = 0) -> list[tuple[Address, int, int]]: ...
    def drain(
        self, window: Any, addr: Address, max_batches: int, min_datagrams: int = 0
    ) -> tuple[int, int, int, int, int]: ...
    def drain_flows(
        self, windows: Sequence[Any], addrs: Sequence[Address], max_batches: int, min_datagrams: int = 0
    ) -> tuple[int, int, list[int], list[int], int]: ...
    def send(self, addr: Address | None, data: Buffer, segment_size: int) -> int: ...
    def send_many(self, items: Iterable[tuple[Address | None, Buffer, int]]) -> int: ...
    def send_segments(
        self,
        addr: Address | None,
        headers: Buffer,
        payload: Buffer,
        seqs: Any,
        seg_size: int,
        total: int,
        background: bool = True,
        pace_rate: float = 0.0,
        pace_quantum: int = 0,
        parts: int = 1,
    ) -> int: ...
    def reap(self) -> int: ...
    def wait_sent(self) -> None: ...
    def stop_send_threads(self) -> None: ...
