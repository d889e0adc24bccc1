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
from .transport.base import TIMEOUT, RecvReport, Transport
from .wire import HEADER_BYTES, GradHeader


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

    async def server_gather(self, transport, peers, bufs, *, tag, timeout):
        """Gather with one Early Close deadline; wait again for workers that had not started.

        LTP's gather reports a peer that never registered a transfer as
        ``regime="timeout"`` once the Early Close deadline passes.  In BSP that
        peer is usually still *computing*, not slow on the network, so the
        stragglers are gathered again (their message is buffered by the
        transport if it starts in between) until ``timeout`` -- the bound after
        which a worker counts as missed.  Transfers that did start keep the
        Early Close semantics of the wave they started in.
        """
        loop = asyncio.get_running_loop()
        end = None if timeout is None else loop.time() + timeout
        peers, bufs = list(peers), list(bufs)
        reps = await transport.gather(peers, bufs, tag=tag, timeout=timeout)
        while True:
            todo = [i for i, r in enumerate(reps) if r.regime == TIMEOUT and r.received_bytes == 0]
            left = None if end is None else end - loop.time()
            if not todo or (left is not None and left <= 0.001):
                return reps
            again = await transport.gather([peers[i] for i in todo], [bufs[i] for i in todo], tag=tag, timeout=left)
            for i, r in zip(todo, again):
                reps[i] = r
            if all(r.regime == TIMEOUT and r.received_bytes == 0 for r in again) and end is None:
                return reps

    async def server_broadcast(self, transport, peers, message, *, tag, timeout):
        return await transport.broadcast(list(peers), message, tag=tag, timeout=timeout)

    async def worker_push(self, transport, server, message, *, critical, tag, timeout):
        return await transport.send(server, message, reliable=False, critical=critical, element_size=4,
                                    tag=tag, timeout=timeout)

    async def worker_pull(self, transport, server, into, *, timeout):
        return await transport.recv(into, peer=server, tag=None, timeout=timeout)


SCHEDULES = {"direct": DirectSchedule}


def get_schedule(name: str) -> Schedule:
    try:
        return SCHEDULES[name]()
    except KeyError:
        from .errors import ConfigError

        raise ConfigError(f"unknown schedule {name!r}; available: {sorted(SCHEDULES)}") from None
