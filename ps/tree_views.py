"""Membership views for tree schedules: which workers a round's trees join, agreed through a board.

Theory of operation
-------------------
A tree schedule (``rat``) joins workers to each other, so a dead worker is
more than a missing gradient: an aggregator's death orphans its subtree (no
parameters come down, no partial goes up) and a dead leaf keeps its
aggregator waiting.  The repair is to plan later rounds on the surviving
workers (:meth:`World.without`), and every process must switch trees at the
same round or their programs disagree.  Three plain objects decide that;
the roles (``ltp_ps.program_roles``) move their inputs and outputs to a
*board* (:class:`MemoryBoard` in memory, :class:`StoreBoard` on the job's
``TCPStore``), which is the only I/O here.

* :class:`Suspicion` (every process): after each round the process feeds
  what it saw of every worker it exchanged with (delivered or not; a
  transfer the transport reported failed, e.g. the peer's socket is gone,
  counts at once).  ``max_missed`` misses in a row make the peer a
  *suspect*, posted on the board once.  PS shards post the workers their
  membership dropped the same way.
* :func:`next_view` (PS shard 0 only, the single author): at the start of
  its round ``r`` it folds every suspect posted so far into a new
  :class:`TreeView` taking effect at round ``r + VIEW_LAG_ROUNDS``, so every
  process can read it before it plans that round (a worker reads the board
  before each round and every ``BOARD_POLL_S`` while a round runs).
* The *decided-through* mark (:func:`decided_through`): with the view it
  may write at the start of its round ``r``, shard 0 posts ``r +
  VIEW_LAG_ROUNDS``, the last round whose view is now final (a later view
  takes effect later).  No other process plans a round beyond the mark: it
  waits for shard 0 first.  ``VIEW_LAG_ROUNDS`` alone does not keep them in
  step: a process whose parameters of shard 0 do not come (its tree for
  shard 0 is orphaned) is clocked by the other shards and can run two
  rounds ahead of shard 0 (seen with ``--num-servers 2``: shard 0 spent
  0.2 s evaluating at an epoch's end, shard 1 planned round 18 with the old
  trees and shard 0 with the new ones, and the PS shards dropped live
  workers that were waiting on the other trees).
* :class:`ViewTracker` (every process): the views seen so far.  Round ``r``
  is planned without ``dead_for(r)`` (the newest view with ``from_round <=
  r``); rounds before a view takes effect already *exclude* its dead workers
  (``newest.dead``: no send to them, no wait for them), and a worker whose
  tree ancestor is among them has nothing to do in that round (an orphan
  round: no parameters can come down, its partial has nowhere to go).

A worker that finds itself in a view was declared dead while alive (e.g. a
straggler that missed ``max_missed`` rounds): tree schedules cannot take it
back (rounds are counted from the start, ``docs/schedules.md``), so it stops
with an error naming the cause.  The PS posts ``stop`` on the board when it
ends the run, so a worker that waits on a round that will not come (an
orphan when the job ends) stops too; a PS shard clears it when it starts
(a restarted PS runs on from its checkpoint).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Iterable, Mapping

#: rounds between the round in which PS shard 0 writes a view and the first round planned with it
VIEW_LAG_ROUNDS = 2
#: seconds between a worker's looks at the board while one of its rounds runs
BOARD_POLL_S = 0.5
#: seconds between a process's looks at the decided-through mark while it waits for PS shard 0
DECIDED_POLL_S = 0.05
#: seconds a PS shard > 0 waits for shard 0's mark at least (or the job's join timeout, if longer): shard 0 may
#: be evaluating or writing a checkpoint of a large model, or restarting from one
SHARD0_WAIT_MIN_S = 60.0
#: most worker ranks a view may name (a peer cannot make a process build an unbounded set)
MAX_VIEW_RANKS = 1 << 16


@dataclasses.dataclass(frozen=True)
class TreeView:
    """Workers excluded from the trees from round ``from_round`` on; views are numbered from 1 (0: everyone)."""

    number: int
    from_round: int
    dead: frozenset = frozenset()

    def to_dict(self) -> dict:
        return {"number": self.number, "from_round": self.from_round, "dead": sorted(self.dead)}

    @classmethod
    def from_dict(cls, d: Mapping) -> "TreeView":
        """Parse a view read from the board; ``ValueError`` on anything malformed."""
        try:
            number, from_round, dead = int(d["number"]), int(d["from_round"]), d["dead"]
            if not isinstance(dead, list) or len(dead) > MAX_VIEW_RANKS:
                raise ValueError("dead must be a list of at most MAX_VIEW_RANKS ranks")
            ranks = frozenset(int(r) for r in dead)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed tree view {d!r}: {exc}") from None
        if number < 0 or from_round < 0 or any(r < 0 for r in ranks):
            raise ValueError(f"malformed tree view {d!r}: negative number, round or rank")
        return cls(number, from_round, ranks)


NO_VIEW = TreeView(0, 0, frozenset())


class ViewTracker:
    """The views one process has seen (sans-IO): which workers round ``r`` is planned without."""

    def __init__(self):
        self._views: list[TreeView] = [NO_VIEW]

    @property
    def newest(self) -> TreeView:
        return self._views[-1]

    def learn(self, view: TreeView | None) -> bool:
        """Take ``view`` if it is newer than every view seen; True if it was."""
        if view is None or view.number <= self.newest.number:
            return False
        if not view.dead >= self.newest.dead:
            raise ValueError(f"tree view {view.number} brings back workers {sorted(self.newest.dead - view.dead)}; "
                             f"views only grow (a worker declared dead cannot rejoin a tree schedule)")
        self._views.append(view)
        return True

    def dead_for(self, round_: int) -> frozenset:
        """Workers the trees of round ``round_`` are planned without."""
        for v in reversed(self._views):
            if v.from_round <= round_:
                return v.dead
        return frozenset()


def decided_through(round_: int) -> int:
    """The last round whose view is final once PS shard 0 has started round ``round_`` (see the module doc)."""
    return round_ + VIEW_LAG_ROUNDS


def next_view(current: TreeView, suspects: Iterable[int], round_: int, decided: int = -1) -> TreeView | None:
    """PS shard 0's decision at the start of its round ``round_``: a new view when any suspect is not yet dead.

    ``decided``: the board's decided-through mark; the view takes effect after it (a restarted shard 0 that
    resumes at an earlier round must not change a round it already declared final)."""
    new = frozenset(int(r) for r in suspects) - current.dead
    if not new:
        return None
    return TreeView(current.number + 1, max(decided_through(round_), decided + 1), current.dead | new)


class Suspicion:
    """Misses in a row per worker peer (sans-IO); a peer becomes a suspect once."""

    def __init__(self, max_missed: int):
        if max_missed < 1:
            raise ValueError(f"max_missed must be >= 1, got {max_missed}")
        self.max_missed = max_missed
        self._missed: dict[int, int] = {}
        self.suspects: dict[int, str] = {}  # rank -> why

    def observe(self, rank: int, ok: bool, why: str = "", *, fatal: bool = False) -> bool:
        """Record one exchange with worker ``rank``; True when it became a suspect now.

        ``fatal``: the transport reported the peer gone (closed or unreachable): a suspect at once."""
        if rank in self.suspects:
            return False
        if ok:
            self._missed[rank] = 0
            return False
        n = self._missed[rank] = self._missed.get(rank, 0) + (self.max_missed if fatal else 1)
        if n >= self.max_missed:
            self.suspects[rank] = why or f"missed {n} rounds in a row"
            return True
        return False


class MemoryBoard:
    """A board in memory, shared by the processes of an in-memory job (tests, simulations)."""

    def __init__(self):
        self._suspects: dict[int, str] = {}
        self._view: TreeView | None = None
        self._stop: int | None = None
        self._decided = -1

    def suspect(self, rank: int, by: str, why: str) -> None:
        self._suspects.setdefault(int(rank), f"{by}: {why}")

    def post_decided(self, round_: int) -> None:
        self._decided = max(self._decided, int(round_))

    def decided(self) -> int:
        return self._decided

    def suspects(self) -> dict[int, str]:
        return dict(self._suspects)

    def publish(self, view: TreeView) -> None:
        if self._view is None or view.number > self._view.number:
            self._view = view

    def latest(self) -> TreeView | None:
        return self._view

    def post_stop(self, round_: int) -> None:
        self._stop = round_

    def clear_stop(self) -> None:
        self._stop = None

    def stopped_at(self) -> int | None:
        return self._stop


class StoreBoard:
    """A board on the job's ``TCPStore`` (every value signed with the job's secret; bad entries are skipped).

    Keys (under the job's prefix): ``tree/suspects`` (a counter) and ``tree/suspect/<i>``; ``tree/views`` (a
    counter) and ``tree/view/<n>``; ``tree/decided``; ``tree/stop``.  Reading costs one store round trip when
    nothing changed."""

    def __init__(self, store, secret: bytes, log=None):
        self.store, self.secret = store, secret
        self.log = log or (lambda msg: None)
        self._n_suspects = 0
        self._suspects: dict[int, str] = {}
        self._n_views = 0
        self._view: TreeView | None = None
        self._decided = -1  # the highest decided-through mark seen or written (it only grows)
        self.rejected = 0  # entries not signed with the job's secret or malformed: skipped

    def _put(self, key: str, d: dict) -> None:
        from .schedule_cli import _sign

        self.store.set(key, _sign(self.secret, d))

    def _get(self, key: str) -> dict | None:
        from .errors import RendezvousError
        from .schedule_cli import _verify

        try:
            return _verify(self.secret, self.store.get(key), key)
        except (RendezvousError, ValueError, TypeError) as exc:
            self.rejected += 1
            self.log(f"[tree-views] skipped {key}: {exc}")
            return None

    def suspect(self, rank: int, by: str, why: str) -> None:
        i = self.store.add("tree/suspects", 1)
        self._put(f"tree/suspect/{i}", {"rank": int(rank), "by": by, "why": why})

    def suspects(self) -> dict[int, str]:
        n = self.store.add("tree/suspects", 0)
        for i in range(self._n_suspects + 1, min(n, MAX_VIEW_RANKS) + 1):
            d = self._get(f"tree/suspect/{i}")
            if d is not None and isinstance(d.get("rank"), int) and d["rank"] >= 0:
                self._suspects.setdefault(d["rank"], f"{d.get('by')}: {d.get('why')}")
        self._n_suspects = max(self._n_suspects, n)
        return dict(self._suspects)

    def publish(self, view: TreeView) -> None:
        """Write ``view`` (its key first, then the counter readers poll); a view not newer than the board's is
        ignored (a restarted shard 0 learns the board's views before it writes)."""
        current = self.store.add("tree/views", 0)
        if view.number <= current:
            return
        self._put(f"tree/view/{view.number}", view.to_dict())
        self.store.add("tree/views", view.number - current)
        self._view, self._n_views = view, view.number

    def latest(self) -> TreeView | None:
        n = self.store.add("tree/views", 0)
        if n > self._n_views:
            d = self._get(f"tree/view/{n}")
            if d is not None:
                try:
                    self._view = TreeView.from_dict(d)
                except ValueError as exc:
                    self.rejected += 1
                    self.log(f"[tree-views] skipped view {n}: {exc}")
            self._n_views = n
        return self._view

    def post_decided(self, round_: int) -> None:
        """Raise the decided-through mark to ``round_`` (PS shard 0, after any view of that round is published);
        a mark not above the highest one seen is not written (the mark only grows: a restarted shard 0 reads
        :meth:`decided` before it writes)."""
        if int(round_) > self._decided:  # the writer read decided() when it started
            self._put("tree/decided", {"round": int(round_)})
            self._decided = int(round_)

    def decided(self) -> int:
        """The decided-through mark (-1 before shard 0 has posted one)."""
        if self.store.check(["tree/decided"]):
            d = self._get("tree/decided")
            r = d.get("round") if d is not None else None
            if isinstance(r, int) and not isinstance(r, bool) and r >= 0:
                self._decided = max(self._decided, r)
            elif d is not None:
                self.rejected += 1
                self.log(f"[tree-views] skipped tree/decided: {d!r} is not a round")
        return self._decided

    def post_stop(self, round_: int) -> None:
        self.store.set("tree/stop", json.dumps(int(round_)))

    def clear_stop(self) -> None:
        """Forget a ``stop`` an earlier incarnation of the PS posted (a restarted PS runs on)."""
        try:
            self.store.delete_key("tree/stop")
        except (AttributeError, RuntimeError):  # a store without delete: overwrite with "none"
            self.store.set("tree/stop", json.dumps(None))

    def stopped_at(self) -> int | None:
        if not self.store.check(["tree/stop"]):
            return None
        try:
            v = json.loads(self.store.get("tree/stop"))
            return None if v is None else int(v)
        except (ValueError, TypeError):
            return None
