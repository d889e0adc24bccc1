"""Compatibility shim for the old ``Schedule`` seam; schedules now live in ``ltp_ps.schedules``.

The old :class:`DirectSchedule` coroutine API (``server_gather``,
``server_broadcast``, ``worker_push``, ``worker_pull``, ``server_recv_one``)
is kept for callers that have not moved (``ltp_ps.ddp``'s bucket server), but
every one of them builds a small round program and runs it on the executor
(``ltp_ps.schedules.executor``): nothing sends around it.  ``plan()`` still
returns the star's edges.  :func:`contribution` and :func:`combine` are the
PS's helpers for raw gradient messages.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from .aggregate import Aggregator, bubbles_to_elements
from .errors import ConfigError, TransportError, TransportTimeout
from .schedules.executor import Executor, Slots
from .schedules.program import CLOCK_ALL, CLOCK_FIRST, RELIABLE, TOLERANT, Program, Recv, Send
from .transport.base import TIMEOUT, RecvReport, Transport
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


def contribution(rank: int, buf: np.ndarray, report: RecvReport, n_elems: int) -> Contribution:
    """Decode one raw gradient message (header, float32 payload, lost element ranges)."""
    header = GradHeader.unpack(buf) if report.received_bytes > 0 else None
    grad = buf[HEADER_BYTES:HEADER_BYTES + 4 * n_elems].view(np.float32)
    lost = bubbles_to_elements(report.bubbles, offset=HEADER_BYTES, n_elems=n_elems)
    if header is None:
        lost = [(0, n_elems)]
    return Contribution(rank, header, grad, lost, report)


def combine(aggregator: Aggregator, contributions: Sequence[Contribution]) -> np.ndarray:
    """Aggregate usable contributions with the aggregator's mean."""
    aggregator.reset()
    for c in contributions:
        if c.usable:
            aggregator.add(c.grad, c.lost)
    return aggregator.result()


def _peer_nodes(peers) -> dict:
    return {f"worker:{i}": tuple(p) for i, p in enumerate(peers)}


class Schedule:
    """Legacy base (kept for type hints); new schedules subclass ``ltp_ps.schedules.Schedule``."""

    name = "abstract"
    contribution = staticmethod(contribution)

    def combine(self, aggregator: Aggregator, contributions: Sequence[Contribution]) -> np.ndarray:
        return combine(aggregator, contributions)


class DirectSchedule(Schedule):
    """The star, as coroutines over the executor (legacy API; see ``ltp_ps.schedules.direct``)."""

    name = "direct"

    def __init__(self, *, ready_handshake: bool = False):
        self.ready_handshake = ready_handshake
        self.last_ready_wait_s: float | None = None

    def plan(self, workers, servers) -> list[Edge]:
        edges = [Edge("push", f"worker:{w}", f"server:{s}", False) for w in workers for s in servers]
        edges += [Edge("pull", f"server:{s}", f"worker:{w}", True) for s in servers for w in workers]
        return edges

    async def server_gather(self, transport: Transport, peers, bufs, *, tag: int, timeout):
        """One Early Close gather whose clock starts once every peer's gradient registered (with
        ``ready_handshake``: READY notes, bounded by ``timeout``, then the gather over the ready peers)."""
        nodes = _peer_nodes(peers)
        ex = Executor(transport, "server:0", nodes, timeout_s=timeout if timeout is not None else 1e9)
        slots = Slots()
        ready_tag = tag - KIND_GRAD + KIND_READY
        stages = []
        if self.ready_handshake:
            for n in nodes:
                slots.bind(f"ready:{n}", np.zeros(READY_BYTES, np.uint8))
            stages.append(tuple(Recv(n, f"ready:{n}", 0, 0, ready_tag, RELIABLE, "note", group="ready")
                                for n in nodes))
        for n, b in zip(nodes, bufs):
            slots.bind(f"in:{n}", b)
        stages.append(tuple(Recv(n, f"in:{n}", 0, 0, tag, TOLERANT, "grad", group="grad",
                                 only_if="ready" if self.ready_handshake else None,
                                 clock=CLOCK_FIRST if self.ready_handshake else CLOCK_ALL) for n in nodes))
        res = await ex.run(Program("server:0", tuple(stages)), slots)
        self.last_ready_wait_s = res.group_s.get("ready")
        return res.reports[-len(nodes):] if nodes else []

    async def server_broadcast(self, transport: Transport, peers, message, *, tag: int, timeout):
        nodes = _peer_nodes(peers)
        ex = Executor(transport, "server:0", nodes, timeout_s=timeout if timeout is not None else 1e9)
        slots = Slots()
        slots.bind("params", message)
        prog = Program("server:0", (tuple(Send(n, "params", 0, 0, tag, RELIABLE, "params") for n in nodes),))
        return (await ex.run(prog, slots)).reports

    async def server_recv_one(self, transport: Transport, peer, buf, *, iteration: int, timeout):
        """Asynchronous mode: this worker's READY (if any) and gradient for ``iteration``."""
        ex = Executor(transport, "server:0", {"worker:0": tuple(peer)}, timeout_s=timeout or 1e9)
        slots = Slots()
        slots.bind("ready", np.zeros(READY_BYTES, np.uint8))
        slots.bind("in", buf)
        stages = []
        if self.ready_handshake:
            stages.append((Recv("worker:0", "ready", 0, 0, tag_of(iteration, KIND_READY), RELIABLE, "note"),))
        stages.append((Recv("worker:0", "in", 0, 0, tag_of(iteration, KIND_GRAD), TOLERANT, "grad"),))
        rep = (await ex.run(Program("server:0", tuple(stages)), slots)).reports[-1]
        if rep.regime == TIMEOUT and rep.received_bytes == 0:
            raise TransportTimeout(f"no gradient from {peer} for iteration {iteration} within {timeout} s")
        return rep

    async def worker_push(self, transport: Transport, server, message, *, critical, tag: int, timeout):
        ex = Executor(transport, "worker:0", {"server:0": tuple(server)}, timeout_s=timeout or 1e9)
        slots = Slots()
        slots.bind("out", message)
        slots.bind_critical("out", critical)
        slots.bind("note", np.zeros(READY_BYTES, np.uint8))
        steps = [Send("server:0", "out", 0, 0, tag, TOLERANT, "grad")]
        if self.ready_handshake:
            steps.insert(0, Send("server:0", "note", 0, 0, tag - KIND_GRAD + KIND_READY, RELIABLE, "note"))
        res = await ex.run(Program("worker:0", (tuple(steps),)), slots)
        for r in res.reports:
            if isinstance(r, BaseException):
                raise r
        return res.reports[-1]

    async def worker_pull(self, transport: Transport, server, into, *, timeout):
        ex = Executor(transport, "worker:0", {"server:0": tuple(server)}, timeout_s=timeout or 1e9)
        slots = Slots()
        slots.bind("params", into)
        res = await ex.run(Program("worker:0", ((Recv("server:0", "params", 0, 0, None, RELIABLE, "params"),),)),
                           slots)
        rep = res.reports[0]
        if rep.received_bytes == 0 and rep.regime == TIMEOUT:
            raise TransportTimeout(f"no parameters from {server} within {timeout} s")
        if rep.received_bytes == 0:
            raise TransportError(f"receiving parameters from {server} failed ({rep.regime}): the PS went away")
        return rep


SCHEDULES = {"direct": DirectSchedule}


def get_schedule(name: str) -> Schedule:
    """Legacy lookup: only the star has the coroutine API; round-plan schedules are in ``ltp_ps.schedules``."""
    try:
        return SCHEDULES[name]()
    except KeyError:
        raise ConfigError(f"unknown legacy schedule {name!r}; available legacy schedules: {sorted(SCHEDULES)}; "
                          f"round-plan schedules (ring, rsgcm, ...) are created with ltp_ps.schedules.create")
