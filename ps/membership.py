"""Who is in the job, as a plain state machine (sans-IO).

Theory of operation
-------------------
Each worker *rank* has one record; its state moves only through this table::

    (none)   --admit-->      ACTIVE     (joined; gets the parameters at the next broadcast)
    ACTIVE   --delivered-->  ACTIVE     (missed := 0)
    ACTIVE   --missed-->     ACTIVE     (missed += 1, while missed < max_missed)
    ACTIVE   --missed-->     DROPPED    (missed reaches max_missed: left out of later iterations)
    ACTIVE   --failed-->     DROPPED    (its broadcast failed: the process is gone)
    any      --admit-->      ACTIVE     (a restarted worker rejoins under the same rank, new address)

Invariants: (1) at most one record per rank; (2) ``active()`` is sorted by rank,
so gather buffers and reports line up deterministically; (3) a rejoin bumps
``generation`` so late events about the old process are ignored.
"""

from __future__ import annotations

import dataclasses
import enum


class State(enum.Enum):
    ACTIVE = "active"
    DROPPED = "dropped"


@dataclasses.dataclass
class Member:
    rank: int
    addr: tuple
    state: State = State.ACTIVE
    missed: int = 0
    generation: int = 0
    joined_iteration: int = 0


@dataclasses.dataclass(frozen=True)
class Event:
    kind: str  # "joined" | "rejoined" | "dropped"
    rank: int
    reason: str = ""


class Membership:
    def __init__(self, *, max_missed: int = 3):
        self.max_missed = max_missed
        self.members: dict[int, Member] = {}
        self.events: list[Event] = []  # not yet drained (for metrics)
        self.events_log: list[Event] = []  # every event, for error messages

    def _emit(self, ev: Event) -> None:
        self.events.append(ev)
        self.events_log.append(ev)

    def admit(self, rank: int, addr: tuple, iteration: int = 0) -> Member:
        old = self.members.get(rank)
        gen = 0 if old is None else old.generation + 1
        m = Member(rank=rank, addr=tuple(addr), generation=gen, joined_iteration=iteration)
        self.members[rank] = m
        self._emit(Event("joined" if old is None else "rejoined", rank))
        return m

    def active(self) -> list[Member]:
        return [m for _, m in sorted(self.members.items()) if m.state is State.ACTIVE]

    def ever_joined(self) -> int:
        return len(self.members)

    def delivered(self, rank: int) -> None:
        m = self.members.get(rank)
        if m is not None and m.state is State.ACTIVE:
            m.missed = 0

    def missed(self, rank: int, reason: str = "missed the gather deadline") -> bool:
        """Record a miss; True if the worker was dropped now."""
        m = self.members.get(rank)
        if m is None or m.state is not State.ACTIVE:
            return False
        m.missed += 1
        if m.missed >= self.max_missed:
            m.state = State.DROPPED
            self._emit(Event("dropped", rank, f"{reason} {m.missed} times"))
            return True
        return False

    def failed(self, rank: int, reason: str) -> None:
        m = self.members.get(rank)
        if m is not None and m.state is State.ACTIVE:
            m.state = State.DROPPED
            self._emit(Event("dropped", rank, reason))

    def drain_events(self) -> list[Event]:
        ev, self.events = self.events, []
        return ev


class Staleness:
    """Asynchronous mode bookkeeping: how old was the model a gradient was computed on."""

    def __init__(self):
        self.count = 0
        self.total = 0
        self.max = 0
        self.histogram: dict[int, int] = {}

    def record(self, used_version: int, current_version: int) -> int:
        s = max(0, current_version - used_version)
        self.count += 1
        self.total += s
        self.max = max(self.max, s)
        self.histogram[s] = self.histogram.get(s, 0) + 1
        return s

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0
