"""``direct``: the paper's star -- every worker pushes to every PS shard, shards broadcast back.

Theory of operation
-------------------
Round ``i`` for shard ``s`` (``server:s``) and worker ``w``::

    server:s  stage 0  Send params -> every worker      reliable, group "params" (one broadcast)
              stage 1  Recv grad   <- workers reached   tolerant, group "grad" (one Early Close gather
                                                        whose clock starts once every gradient registered)
              stage 2  Combine every grad into "acc"; Apply "acc" (the PS's optimizer)
    worker:w  stage 0  Recv params <- every shard       reliable, any tag (the message names the round)
              stage 1  Compute
              stage 2  Send grad -> every shard         tolerant, the header and each tensor's
                                                        first/last element critical

Where the gather's clock starts: the paper's gather starts its Early Close
clock at the first registration and expires peers that have not registered
by the deadline.  A worker that is still computing is not a network long
tail, so the gather's clock starts once every worker's gradient has
registered (``clock="all"``, ``ltp.early_close.GroupClock``), and only the
caller's bound (the gather timeout) waits for a worker that never does.

``ready_handshake=True`` keeps the older form, which did the same with the
paper's clock: each worker sent a tiny reliable READY note before its
gradient (stage 1 ``Recv READY``, group "ready"), and the PS posted the
gather only once the notes were in.  On two shared cores a READY note cost
LTP as much CPU as a gradient's control path, a third of a digits round's
messages (docs/performance.md, session 54).  The same protocol runs over TCP
so that timings compare like with like.

This is the old ``ltp_ps.schedule.DirectSchedule`` re-expressed as data; its
behaviour on the wire (tags, kinds, message layouts, the handshake) is
unchanged apart from the tag packing.
"""

from __future__ import annotations

from ..aggregate import critical_ranges
from .base import Schedule, World
from .program import (CLOCK_ALL, CLOCK_FIRST, RELIABLE, SLOT_ACC, SLOT_PARAMS, TOLERANT, Apply, Combine, Compute,
                      Program, Recv, RoundPlan, Send, server, worker)
from .tags import PHASE_PUSH, pack

# Message kinds are the wire's (``ltp_ps.wire``); repeated here as plain ints to keep the planner import-light.
KIND_GRAD, KIND_PARAMS, KIND_STOP, KIND_READY = 1, 2, 3, 4


def grad_slot(rank: int) -> str:
    return f"in:{worker(rank)}"


def ready_slot(rank: int) -> str:
    return f"ready:{worker(rank)}"


def params_slot(shard: int) -> str:
    return f"{SLOT_PARAMS}:{server(shard)}"


def out_slot(shard: int) -> str:
    return f"out:{server(shard)}"


def note_slot(shard: int) -> str:
    return f"note:{server(shard)}"


def push_tag(iteration: int, kind: int) -> int:
    return pack(iteration, PHASE_PUSH, 0, 0, kind)


def pull_tag(iteration: int, kind: int) -> int:
    """Parameters and STOP keep ``wire.tag_of(i, kind)`` (push phase), as the DDP bucket path does."""
    return pack(iteration, PHASE_PUSH, 0, 0, kind)


class DirectSchedule(Schedule):
    """Worker -> PS gather, PS -> worker broadcast (the paper's PS architecture)."""

    name = "direct"

    def __init__(self, world: World, *, rng=None, ready_handshake: bool = False, edge_elems: int = 1,
                 max_critical_ranges: int = 128):
        super().__init__(world, rng=rng)
        self.ready_handshake = ready_handshake
        self.edge_elems = edge_elems
        self.max_critical_ranges = max_critical_ranges

    def _critical(self, lo: int, hi: int) -> tuple:
        """Absolute element ranges of the shard that are critical (first/last elements of every tensor)."""
        if not self.world.layout:
            return ()
        byte = critical_ranges(self.world.layout, header_bytes=0, shard=(lo, hi), edge_elems=self.edge_elems,
                               max_ranges=self.max_critical_ranges - 1)
        return tuple((lo + a // 4, lo + -(-b // 4)) for a, b in byte)

    def server_program(self, shard: int, iteration: int, workers=None) -> Program:
        lo, hi = self.world.shards[shard]
        ws = self.world.workers if workers is None else workers
        t_par, t_grad, t_ready = (pull_tag(iteration, KIND_PARAMS), push_tag(iteration, KIND_GRAD),
                                  push_tag(iteration, KIND_READY))
        bcast = tuple(Send(worker(w), SLOT_PARAMS, lo, hi, t_par, RELIABLE, "params", group="params") for w in ws)
        gather = tuple(Recv(worker(w), grad_slot(w), lo, hi, t_grad, TOLERANT, "grad", group="grad",
                            only_if="ready" if self.ready_handshake else "params",
                            clock=CLOCK_FIRST if self.ready_handshake else CLOCK_ALL) for w in ws)
        stages = [bcast]
        if self.ready_handshake:
            stages.append(tuple(Recv(worker(w), ready_slot(w), 0, 0, t_ready, RELIABLE, "note", group="ready",
                                     only_if="params") for w in ws))
        stages.append(gather)
        stages.append(tuple(Combine(SLOT_ACC, grad_slot(w), lo, hi) for w in ws) + (Apply(SLOT_ACC, lo, hi),))
        return Program(server(shard), tuple(stages))

    def worker_program(self, rank: int, iteration: int) -> Program:
        pull = tuple(Recv(server(s), params_slot(s), lo, hi, None, RELIABLE, "params")
                     for s, (lo, hi) in enumerate(self.world.shards))
        push = []
        for s, (lo, hi) in enumerate(self.world.shards):
            if self.ready_handshake:
                push.append(Send(server(s), note_slot(s), 0, 0, push_tag(iteration, KIND_READY), RELIABLE, "note"))
            push.append(Send(server(s), out_slot(s), lo, hi, push_tag(iteration, KIND_GRAD), TOLERANT, "grad",
                             critical=self._critical(lo, hi)))
        return Program(worker(rank), (pull, (Compute(),), tuple(push)))

    def plan(self, iteration: int) -> RoundPlan:
        progs = {server(s): self.server_program(s, iteration) for s in range(len(self.world.shards))}
        progs.update({worker(w): self.worker_program(w, iteration) for w in self.world.workers})
        return RoundPlan(self.name, iteration, progs, self.apply_at)

    def stop_program(self, shard: int, iteration: int, workers) -> Program:
        """The PS's last message to ``workers``: STOP (reliable, one broadcast)."""
        lo, hi = self.world.shards[shard]
        t = pull_tag(iteration, KIND_STOP)
        return Program(server(shard), (tuple(Send(worker(w), SLOT_PARAMS, lo, hi, t, RELIABLE, "stop", group="stop")
                                             for w in workers),))

    def async_program(self, shard: int, rank: int, version: int) -> Program:
        """Asynchronous mode, one worker: parameters at ``version`` out, its READY and gradient back."""
        lo, hi = self.world.shards[shard]
        w = worker(rank)
        stages = [(Send(w, SLOT_PARAMS, lo, hi, pull_tag(version, KIND_PARAMS), RELIABLE, "params",
                        group="params"),)]
        if self.ready_handshake:
            stages.append((Recv(w, ready_slot(rank), 0, 0, push_tag(version, KIND_READY), RELIABLE, "note",
                                only_if="params"),))
        stages.append((Recv(w, grad_slot(rank), lo, hi, push_tag(version, KIND_GRAD), TOLERANT, "grad",
                            only_if="params"),))
        return Program(server(shard), tuple(stages))

    def predict_s(self, nbytes: int | None = None) -> float | None:
        from .estimate import predict_round_s

        return predict_round_s(self.plan(0), self.world, nbytes)


SCHEDULE = DirectSchedule
