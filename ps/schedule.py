"""Schedules: who sends what to whom, when, and how it is combined.

A :class:`Schedule` owns the communication pattern of one synchronisation
round; the server and worker loops only call its four coroutines and
``combine``.  Plug-ins (MLfabric ordering/aggregation, RSGCM rings, RAT trees,
Hoplite chains) subclass it: e.g. a tree schedule makes ``worker_push`` forward
to a parent that partially aggregates, and ``server_gather`` receive from the
tree roots only.  ``plan()`` describes the pattern as plain data (edges per
phase) so it can be tested and drawn without sockets.

The default, :class:`DirectSchedule`, is the paper's: every worker sends its
gradient straight to each PS shard (loss-tolerant, one Early Close deadline
over the whole incast), and each shard broadcasts the new parameters straight
back (reliable).
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
from typing import Sequence

import numpy as np

from .aggregate import Aggregator, bubbles_to_elements
from .transport.base import RecvReport, Transport, gather_by_recv, missing_report
from .wire import HEADER_BYTES, KIND_GRAD, KIND_READY, READY_BYTES, GradHeader, tag_of


@dataclasses.dataclass(frozen=True)
class Edge:
    phase: str  # "push" | "pull"
    src: str  # "worker:3", "server:0"
    dst: str
    reliable: bool


@dataclasses.dataclass
class Contribution:
    """One worker's gradient as the PS received it."""

    rank: int
    header: GradHeader | None
    grad: np.ndarray | None  # float32 view of the receive buffer
    lost: list  # element ranges
    report: RecvReport

    @property
    def usable(self) -> bool:
        return self.header is not None and self.report.critical_complete and self.report.received_bytes > 0


class Schedule(abc.ABC):
    name = "abstract"

    @abc.abstractmethod
    def plan(self, workers: Sequence[int], servers: Sequence[int]) -> list[Edge]:
        """The transfers of one round, as data."""

    @abc.abstractmethod
    async def server_gather(self, transport: Transport, peers: Sequence[tuple], bufs: Sequence[np.ndarray], *,
                            tag: int, timeout: float | None) -> list[RecvReport]:
        """Collect one gradient message per worker into ``bufs`` (byte arrays)."""

    @abc.abstractmethod
    async def server_broadcast(self, transport: Transport, peers: Sequence[tuple], message, *, tag: int,
                               timeout: float | None) -> list:
        """Send the parameter message to every worker; one report or exception per peer."""

    @abc.abstractmethod
    async def worker_push(self, transport: Transport, server: tuple, message, *, critical, tag: int,
                          timeout: float | None):
        """Send this worker's gradient message towards the server."""

    @abc.abstractmethod
    async def worker_pull(self, transport: Transport, server: tuple, into, *, timeout: float | None) -> RecvReport:
        """Receive the next parameter message from the server."""

    def combine(self, aggregator: Aggregator, contributions: Sequence[Contribution]) -> np.ndarray:
        """Aggregate usable contributions; default: the aggregator's mean."""
        aggregator.reset()
        for c in contributions:
            if c.usable:
                aggregator.add(c.grad, c.lost)
        return aggregator.result()

    @staticmethod
    def contribution(rank: int, buf: np.ndarray, report: RecvReport, n_elems: int) -> Contribution:
        header = GradHeader.unpack(buf) if report.received_bytes > 0 else None
        grad = buf[HEADER_BYTES:HEADER_BYTES + 4 * n_elems].view(np.float32)
        lost = bubbles_to_elements(report.bubbles, offset=HEADER_BYTES, n_elems=n_elems)
        if header is None:
            lost = [(0, n_elems)]
        return Contribution(rank, header, grad, lost, report)


class DirectSchedule(Schedule):
    """Worker -> PS gather, PS -> worker broadcast (the paper's PS architecture)."""

    name = "direct"

    def plan(self, workers, servers):
        edges = [Edge("push", f"worker:{w}", f"server:{s}", False) for w in workers for s in servers]
        edges += [Edge("pull", f"server:{s}", f"worker:{w}", True) for s in servers for w in workers]
        return edges

    def __init__(self, *, ready_handshake: bool = True):
        self.ready_handshake = ready_handshake
        self.last_ready_wait_s: float | None = None

    async def server_gather(self, transport, peers, bufs, *, tag, timeout):
        """READY notes first (bounded by ``timeout``), then one Early Close gather over the ready workers.

        Why the handshake: LTP's gather starts its Early Close clock at the
        first registration and expires peers that have not registered by the
        deadline (their late flow is then refused).  A BSP worker that is
        still *computing* is not a network long tail, so the PS waits for each
        worker's READY note (up to ``timeout``, the bound after which the worker
        counts as missed) and only then posts the gather, so Early Close
        judges transfers, not compute.  Workers send READY and the gradient
        back to back; a gradient that registers before the gather is posted
        is buffered by the transport.  The same protocol runs over TCP, so
        batch-synchronisation times compare like with like.
        """
        loop = asyncio.get_running_loop()
        peers, bufs = list(peers), list(bufs)
        if not self.ready_handshake:
            return await transport.gather(peers, bufs, tag=tag, timeout=timeout)
        t0 = loop.time()
        ready_tag = tag - KIND_GRAD + KIND_READY
        notes = [np.zeros(READY_BYTES, np.uint8) for _ in peers]
        ready = await gather_by_recv(transport, peers, notes, tag=ready_tag, timeout=timeout)
        self.last_ready_wait_s = loop.time() - t0  # compute time of the slowest worker, as seen by the PS
        idx = [i for i, r in enumerate(ready) if r.received_bytes > 0]
        reps = [missing_report(p, tag, b.nbytes, r.regime, loop.time() - t0) for p, b, r in zip(peers, bufs, ready)]
        if idx:
            left = None if timeout is None else max(0.001, timeout - (loop.time() - t0))
            got = await transport.gather([peers[i] for i in idx], [bufs[i] for i in idx], tag=tag, timeout=left)
            for i, r in zip(idx, got):
                reps[i] = r
        return reps

    async def server_recv_one(self, transport, peer, buf, *, iteration: int, timeout):
        """Asynchronous mode: this worker's READY (if any) and gradient for ``iteration``."""
        if self.ready_handshake:
            await transport.recv(np.zeros(READY_BYTES, np.uint8), peer=peer, tag=tag_of(iteration, KIND_READY),
                                 timeout=timeout)
        return await transport.recv(buf, peer=peer, tag=tag_of(iteration, KIND_GRAD), timeout=timeout)

    async def server_broadcast(self, transport, peers, message, *, tag, timeout):
        return await transport.broadcast(list(peers), message, tag=tag, timeout=timeout)

    async def worker_push(self, transport, server, message, *, critical, tag, timeout):
        grad = transport.send(server, message, reliable=False, critical=critical, element_size=4, tag=tag,
                              timeout=timeout)
        if not self.ready_handshake:
            return await grad
        note = transport.send(server, np.zeros(READY_BYTES, np.uint8), reliable=True, element_size=4,
                              tag=tag - KIND_GRAD + KIND_READY, timeout=timeout)
        _, rep = await asyncio.gather(note, grad)
        return rep

    async def worker_pull(self, transport, server, into, *, timeout):
        return await transport.recv(into, peer=server, tag=None, timeout=timeout)


SCHEDULES = {"direct": DirectSchedule}


def get_schedule(name: str) -> Schedule:
    try:
        return SCHEDULES[name]()
    except KeyError:
        from .errors import ConfigError

        raise ConfigError(f"unknown schedule {name!r}; available: {sorted(SCHEDULES)}") from None
