"""Round programs: what each node does in one round, as plain data.

Theory of operation
-------------------
A schedule (``ltp_ps.schedules.base.Schedule``) turns its world (ranks,
shards, topology, link reports) into a :class:`RoundPlan` per round: for every
node (``"worker:3"``, ``"server:0"``) one :class:`Program`.  A program is a
sequence of *stages*; the steps of one stage run concurrently and a stage
starts when the previous one has finished (or hit its deadline).  Nothing
here does I/O: tests inspect plans, ``ltp-ps plan`` prints them as JSON, and
one executor (``ltp_ps.schedules.executor``) runs any of them over a
``Transport``.

Data lives in named *slots* of the node running the program:

* ``SLOT_GRAD``    this worker's gradient (as a partial: count 1 per element);
* ``SLOT_ACC``     the accumulator partial a node reduces into;
* ``SLOT_PARAMS``  the parameters (full model on a worker, its shard on a PS);
* any other name   a receive slot the program names (``"in:worker:2:0"``).

Element ranges ``[lo, hi)`` are absolute model elements, so a ring chunk, a
tree slice and a PS shard are named the same way everywhere.

Steps:

* :class:`Send` / :class:`Recv` -- move ``[lo, hi)`` of a slot to/from a peer
  with ``mode`` ``"reliable"`` or ``"tolerant"`` (loss-tolerant; ``critical``
  element ranges must arrive).  ``payload`` says what the bytes are
  (``"partial"``, ``"grad"``, ``"params"``, ``"note"``, ``"stop"``,
  ``"grant"``).  Recvs in one stage that share a ``group`` are posted as one
  ``Transport.gather`` (one Early Close deadline over all of them); a Recv
  with ``only_if`` waits only for peers that delivered in that earlier group.
* :class:`Combine` -- merge the partial in slot ``src`` into slot ``dst``.
* :class:`Apply` -- the node's optimizer steps ``[lo, hi)`` with the mean of
  the partial in ``slot`` (PS for direct/MLfabric/trees, every worker for
  rings).
* :class:`Forward` -- send a received slot on unchanged (chains, trees).
* :class:`Adopt` -- copy the mean held in ``slot`` into the parameters or
  gradient the node hands back (all-gather results).
* :class:`Compute` -- the worker computes its gradient here (between pulling
  parameters and pushing); the role's handler may end the program (STOP).

Dynamic schedules (Hoplite's receiver-driven chains, MLfabric's grants) give a
:class:`Controller` instead of (or besides) fixed programs: events in
(:class:`NodeReady`, :class:`ChunkArrived`, :class:`TransferDone`,
:class:`NodeFailed`), :class:`Grant` directives (a node's next steps, a start
time, or a drop) out.  The controller is sans-IO like a planner: it takes
``now`` and never reads a clock.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Iterable, Mapping, Sequence, Union

RELIABLE = "reliable"
TOLERANT = "tolerant"
MODES = (RELIABLE, TOLERANT)

PAYLOADS = ("partial", "grad", "params", "note", "stop", "grant")
#: where a receive group's Early Close clock starts (``ltp.early_close.GroupClock``): its first registration, or
#: once every member's message registered (members that may still be computing; no READY note needed)
CLOCK_FIRST = "first"
CLOCK_ALL = "all"
CLOCKS = (CLOCK_FIRST, CLOCK_ALL)

SLOT_GRAD = "grad"
SLOT_ACC = "acc"
SLOT_PARAMS = "params"

ROLE_SERVER = "server"
ROLE_WORKER = "worker"

APPLY_AT_SERVER = "server"  # the PS runs the optimizer (direct, MLfabric, trees, Hoplite)
APPLY_AT_WORKERS = "workers"  # every worker runs it on the reduced gradient (rings)


def worker(rank: int) -> str:
    """Node id of worker ``rank``."""
    return f"{ROLE_WORKER}:{int(rank)}"


def server(shard: int) -> str:
    """Node id of PS shard ``shard``."""
    return f"{ROLE_SERVER}:{int(shard)}"


def parse_node(node: str) -> tuple[str, int]:
    """``"worker:3"`` -> ``("worker", 3)``."""
    role, _, idx = node.partition(":")
    if role not in (ROLE_SERVER, ROLE_WORKER) or not idx.isdigit():
        raise ValueError(f"bad node id {node!r}; use 'worker:<rank>' or 'server:<shard>'")
    return role, int(idx)


def _check_range(lo: int, hi: int) -> None:
    if not 0 <= lo <= hi:
        raise ValueError(f"bad element range [{lo}, {hi})")


@dataclasses.dataclass(frozen=True)
class Send:
    """Send elements ``[lo, hi)`` of ``slot`` to ``peer`` with ``tag``."""

    peer: str
    slot: str
    lo: int
    hi: int
    tag: int
    mode: str = TOLERANT
    payload: str = "partial"
    critical: tuple = ()  # absolute element ranges that must arrive (besides header/tables)
    timeout_s: float | None = None  # seconds; None: the executor's default for the payload
    group: str | None = None  # names the peers this stage reached, for a later Recv's ``only_if``
    #: the planner's word that nothing later waits on this send's end: a ``"partial"`` send so marked finishes
    #: beside the later stages (executor, *Detached sends*); ring and RSGCM mark theirs
    detach: bool = False
    op: str = dataclasses.field(default="send", init=False)

    def __post_init__(self):
        _check_range(self.lo, self.hi)
        if self.mode not in MODES or self.payload not in PAYLOADS:
            raise ValueError(f"Send mode {self.mode!r}/payload {self.payload!r}: use {MODES} / {PAYLOADS}")


@dataclasses.dataclass(frozen=True)
class Recv:
    """Receive elements ``[lo, hi)`` from ``peer`` with ``tag`` into ``slot``."""

    peer: str
    slot: str
    lo: int
    hi: int
    tag: int | None  # None: any tag from ``peer`` (a worker's pull learns the round from the message)
    mode: str = TOLERANT
    payload: str = "partial"
    group: str | None = None  # Recvs of one stage with one group share a gather (one Early Close deadline)
    only_if: str | None = None  # post only if ``peer`` delivered in this earlier group (READY handshake)
    timeout_s: float | None = None
    clock: str = CLOCK_FIRST  # the group's Early Close clock (CLOCKS): members of one group give the same
    op: str = dataclasses.field(default="recv", init=False)

    def __post_init__(self):
        _check_range(self.lo, self.hi)
        if self.mode not in MODES or self.payload not in PAYLOADS:
            raise ValueError(f"Recv mode {self.mode!r}/payload {self.payload!r}: use {MODES} / {PAYLOADS}")
        if self.clock not in CLOCKS:
            raise ValueError(f"Recv clock {self.clock!r}: use one of {CLOCKS}")


@dataclasses.dataclass(frozen=True)
class Combine:
    """Merge the partial in ``src`` (elements ``[lo, hi)``) into ``dst``."""

    dst: str
    src: str
    lo: int
    hi: int
    op: str = dataclasses.field(default="combine", init=False)


@dataclasses.dataclass(frozen=True)
class Apply:
    """Optimizer step on ``[lo, hi)`` with the mean of the partial in ``slot``."""

    slot: str
    lo: int
    hi: int
    op: str = dataclasses.field(default="apply", init=False)


@dataclasses.dataclass(frozen=True)
class Forward:
    """Send what arrived in ``slot`` on to ``peer`` unchanged (chains, trees, broadcast relays)."""

    peer: str
    slot: str
    lo: int
    hi: int
    tag: int
    mode: str = TOLERANT
    payload: str = "partial"
    timeout_s: float | None = None
    group: str | None = None  # as :attr:`Send.group`: names the peers this stage reached
    op: str = dataclasses.field(default="forward", init=False)


@dataclasses.dataclass(frozen=True)
class Adopt:
    """The reduced result for ``[lo, hi)`` is the partial in ``slot`` (a worker's all-gather output)."""

    slot: str
    lo: int
    hi: int
    op: str = dataclasses.field(default="adopt", init=False)


@dataclasses.dataclass(frozen=True)
class Compute:
    """The worker computes its gradient (into ``slot``) at the parameters it holds now."""

    slot: str = SLOT_GRAD
    op: str = dataclasses.field(default="compute", init=False)


Step = Union[Send, Recv, Combine, Apply, Forward, Adopt, Compute]
STEP_TYPES = {"send": Send, "recv": Recv, "combine": Combine, "apply": Apply, "forward": Forward, "adopt": Adopt,
              "compute": Compute}


@dataclasses.dataclass(frozen=True)
class Program:
    """One node's steps for one round: stages run in order, the steps of a stage concurrently."""

    node: str
    stages: tuple = ()  # tuple[tuple[Step, ...], ...]

    def steps(self) -> list:
        return [s for st in self.stages for s in st]

    def sends(self) -> list:
        return [s for s in self.steps() if s.op in ("send", "forward")]

    def recvs(self) -> list:
        return [s for s in self.steps() if s.op == "recv"]

    def head(self, k: int) -> "Program":
        """The first ``k`` stages (roles that act between stages run a program in parts)."""
        return Program(self.node, self.stages[:k])

    def tail(self, k: int) -> "Program":
        """The stages from ``k`` on."""
        return Program(self.node, self.stages[k:])

    def to_json(self) -> dict:
        return {"node": self.node, "stages": [[step_to_json(s) for s in st] for st in self.stages]}

    @classmethod
    def from_json(cls, d: Mapping) -> "Program":
        return cls(d["node"], tuple(tuple(step_from_json(s) for s in st) for st in d["stages"]))


def step_to_json(step) -> dict:
    d = dataclasses.asdict(step)
    if "critical" in d:
        d["critical"] = [list(r) for r in d["critical"]]
    return d


def step_from_json(d: Mapping):
    d = dict(d)
    cls = STEP_TYPES.get(d.pop("op", None))
    if cls is None:
        raise ValueError(f"unknown step {d!r}; ops are {sorted(STEP_TYPES)}")
    if "critical" in d:
        d["critical"] = tuple(tuple(r) for r in d["critical"])
    return cls(**d)


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    """Every node's program for one round, plus who applies the optimizer."""

    schedule: str
    iteration: int
    programs: Mapping  # node -> Program
    apply_at: str = APPLY_AT_SERVER
    notes: Mapping = dataclasses.field(default_factory=dict)  # planner's extra data (rings, trees, predicted times)

    def program(self, node: str) -> Program:
        """The program of ``node`` (an empty one if it has nothing to do this round)."""
        return self.programs.get(node) or Program(node)

    def edges(self) -> list[tuple]:
        """``(src, dst, lo, hi, tag, mode)`` of every transfer, from the senders' programs."""
        return [(node, s.peer, s.lo, s.hi, s.tag, s.mode) for node, p in sorted(self.programs.items())
                for s in p.sends()]

    def check(self) -> None:
        """Every send has exactly one matching receive (same peers and tag) and vice versa."""
        sends = {}
        for node, p in self.programs.items():
            for s in p.sends():
                key = (node, s.peer, s.tag)
                if key in sends:
                    raise ValueError(f"{node} sends twice to {s.peer} with tag {s.tag}; tags must be unique per pair")
                sends[key] = s
        recvs = {}
        for node, p in self.programs.items():
            for r in p.recvs():
                if r.tag is None:  # wildcard: matches every send of that peer to this node
                    for k in [k for k in sends if k[0] == r.peer and k[1] == node]:
                        recvs[k] = dataclasses.replace(r, tag=k[2])
                    continue
                key = (r.peer, node, r.tag)
                if key in recvs:
                    raise ValueError(f"{node} receives twice from {r.peer} with tag {r.tag}")
                recvs[key] = r
        missing = set(sends) ^ set(recvs)
        if missing:
            raise ValueError(f"unmatched transfers (src, dst, tag): {sorted(missing)[:5]}")
        for k, s in sends.items():
            r = recvs[k]
            if (s.lo, s.hi, s.mode) != (r.lo, r.hi, r.mode):
                raise ValueError(f"transfer {k}: send [{s.lo},{s.hi}) {s.mode} != recv [{r.lo},{r.hi}) {r.mode}")

    def to_json(self) -> dict:
        return {"schedule": self.schedule, "iteration": self.iteration, "apply_at": self.apply_at,
                "notes": dict(self.notes),
                "programs": {n: p.to_json() for n, p in sorted(self.programs.items())}}

    @classmethod
    def from_json(cls, d: Mapping) -> "RoundPlan":
        return cls(d["schedule"], d["iteration"], {n: Program.from_json(p) for n, p in d["programs"].items()},
                   d.get("apply_at", APPLY_AT_SERVER), d.get("notes", {}))


# -- dynamic schedules ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class NodeReady:
    """``node`` has its input for ``iteration`` (gradient computed, update ready)."""

    node: str
    iteration: int
    nbytes: int = 0
    version: int = 0  # model version the update was computed on (async schedules)
    norm: float = 0.0


@dataclasses.dataclass(frozen=True)
class ChunkArrived:
    """``node`` holds elements ``[lo, hi)`` of object ``key`` (complete or partial)."""

    node: str
    key: str
    lo: int
    hi: int
    complete: bool = True


@dataclasses.dataclass(frozen=True)
class TransferDone:
    """A granted transfer finished (``ok=False``: it failed or timed out)."""

    src: str
    dst: str
    tag: int
    ok: bool = True
    duration_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class NodeFailed:
    node: str
    reason: str = ""


Event = Union[NodeReady, ChunkArrived, TransferDone, NodeFailed]


@dataclasses.dataclass(frozen=True)
class Grant:
    """A controller's directive to one node: run ``steps`` (one stage) at ``start_at``, or drop its update.

    ``after`` (a *continuation*, Hoplite's cut-through hops): the slot of a receive granted to the same node
    earlier; the node runs this grant only once that receive ended well (a tolerant receive got bytes), and
    then runs its local steps (the Combine of that slot, at most once per slot) *before* its transfers.  If
    the receive failed the node drops the grant and the controller grants what replaces it."""

    node: str
    steps: tuple = ()
    start_at: float | None = None  # seconds, on the controller's clock; None: now
    drop: bool = False
    reason: str = ""
    after: str | None = None

    def to_json(self) -> dict:
        d = {"node": self.node, "steps": [step_to_json(s) for s in self.steps], "start_at": self.start_at,
             "drop": self.drop, "reason": self.reason}
        if self.after is not None:
            d["after"] = self.after
        return d

    @classmethod
    def from_json(cls, d: Mapping) -> "Grant":
        after = d.get("after")
        if after is not None and not isinstance(after, str):
            raise ValueError(f"grant 'after' must be a slot name, got {after!r}")
        return cls(d["node"], tuple(step_from_json(s) for s in d["steps"]), d.get("start_at"),
                   bool(d.get("drop", False)), d.get("reason", ""), after)


class Controller(abc.ABC):
    """A sans-IO run-time decider (Hoplite's directory, MLfabric's PS controller).

    The executor feeds it events as they happen and sends each returned
    :class:`Grant` to its node (reliably, ``payload="grant"``); nodes run
    granted steps as they come.  ``done()`` says when the round is closed.
    """

    @abc.abstractmethod
    def start(self, iteration: int, nodes: Sequence[str], *, now: float) -> list[Grant]:
        """Begin a round over ``nodes``; initial grants."""

    @abc.abstractmethod
    def on_event(self, event: Event, *, now: float) -> list[Grant]:
        """React to one event; new grants."""

    def next_deadline(self) -> float | None:
        """When :meth:`on_timer` wants to run next (seconds), or None."""
        return None

    def on_timer(self, *, now: float) -> list[Grant]:
        return []

    @abc.abstractmethod
    def done(self) -> bool:
        """True once the round is closed (every input reduced or written off)."""


def merge_programs(programs: Iterable[Program]) -> dict:
    """``{node: Program}`` with the stages of programs of one node concatenated in order."""
    out: dict = {}
    for p in programs:
        prev = out.get(p.node)
        out[p.node] = p if prev is None else Program(p.node, prev.stages + p.stages)
    return out
