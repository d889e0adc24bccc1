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
  process can read it before it plans that round (a worker looks at the
  board beside each round, at its start and every ``BOARD_POLL_S``; the
  look at the start holds the next round's view, see :meth:`StoreBoard.look`).
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

**Coming back.** A worker that finds itself in a view was declared dead
while alive (paused, cut off, or a straggler that missed ``max_missed``
rounds).  It asks to come back (:meth:`MemoryBoard.ask_back`, naming the
*generation* it would return as: one more than the view's count of its
returns) and keeps stepping through rounds without taking part, clocked by
the decided-through mark like every process, so it is never more than
``VIEW_LAG_ROUNDS`` rounds ahead of shard 0.  Shard 0 folds the request into
its next view (:func:`next_view`): the worker leaves the dead set and its
generation goes up, from the view's ``from_round``.  That round is past
every mark the worker has seen, so the worker reaches it in step and plans
it with the trees that include it again; parameters come down the tree in
that round as in any other.  Generations keep old news from excluding it
again: a suspicion names the generation it was about (every process keys its
:class:`Suspicion` by it), and shard 0 folds only suspicions of the current
generation.  A worker comes back at most ``--max-returns`` times
(:data:`MAX_RETURNS` by default; 0: never, as before returns existed): a
straggler that keeps missing would otherwise cost the job its bound every few
rounds, for good; after that it stops with an error naming the cause.

The PS posts ``stop`` on the board when it ends the run, so a worker that
waits on a round that will not come (an orphan when the job ends) stops too;
a PS shard clears it when it starts (a restarted PS runs on from its
checkpoint).
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
#: what a read of the store compares a key's value with: no value written is ever equal to it (``StoreBoard._peek``)
_PEEK = "\x00ltp-peek"
#: times a worker declared dead may come back by default (``--max-returns``; see "Coming back" above)
MAX_RETURNS = 3
#: the most ``--max-returns`` may say, and the highest generation a view read from the board may name
RETURNS_LIMIT = 64


@dataclasses.dataclass(frozen=True)
class TreeView:
    """Workers excluded from the trees from round ``from_round`` on; views are numbered from 1 (0: everyone).

    ``returns``: ``(rank, generation, since)`` triples, sorted, of the workers that came back: how many times
    (absent = 0) and the round their latest return took effect."""

    number: int
    from_round: int
    dead: frozenset = frozenset()
    returns: tuple = ()

    def gen(self, rank: int) -> int:
        """How many times worker ``rank`` came back (its generation)."""
        return next((g for r, g, _ in self.returns if r == int(rank)), 0)

    def since(self, rank: int) -> int:
        """The round from which worker ``rank``'s latest return took effect (0: it never came back)."""
        return next((s for r, _, s in self.returns if r == int(rank)), 0)

    def to_dict(self) -> dict:
        return {"number": self.number, "from_round": self.from_round, "dead": sorted(self.dead),
                "returns": [list(p) for p in self.returns]}

    @classmethod
    def from_dict(cls, d: Mapping) -> "TreeView":
        """Parse a view read from the board; ``ValueError`` on anything malformed."""
        try:
            number, from_round, dead = int(d["number"]), int(d["from_round"]), d["dead"]
            if not isinstance(dead, list) or len(dead) > MAX_VIEW_RANKS:
                raise ValueError("dead must be a list of at most MAX_VIEW_RANKS ranks")
            ranks = frozenset(int(r) for r in dead)
            rets = d.get("returns", [])
            if not isinstance(rets, list) or len(rets) > MAX_VIEW_RANKS:
                raise ValueError("returns must be a list of at most MAX_VIEW_RANKS triples")
            triples = {int(r): (int(g), int(since)) for r, g, since in rets}
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed tree view {d!r}: {exc}") from None
        if number < 0 or from_round < 0 or any(r < 0 for r in ranks) or \
                any(r < 0 or not 0 < g <= RETURNS_LIMIT or not 0 <= since <= from_round
                    for r, (g, since) in triples.items()):
            raise ValueError(f"malformed tree view {d!r}: negative number, round or rank, a generation outside "
                             f"1..RETURNS_LIMIT, or a return after the view's round")
        return cls(number, from_round, ranks, tuple(sorted((r, g, since) for r, (g, since) in triples.items())))


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
        old = self.newest
        back = old.dead - view.dead
        if any(view.gen(r) <= old.gen(r) for r in back) or any(view.gen(r) < g for r, g, _ in old.returns):
            raise ValueError(f"tree view {view.number} brings back workers {sorted(back)} without a new generation "
                             f"(returns {list(view.returns)} after {list(old.returns)}); a dead worker leaves the "
                             f"dead set only by coming back, one generation up")
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


def next_view(current: TreeView, suspects: Iterable, round_: int, decided: int = -1,
              backs: Mapping | None = None, max_returns: int = MAX_RETURNS) -> TreeView | None:
    """PS shard 0's decision at the start of its round ``round_``: a new view when a suspect is not yet dead or
    a dead worker asked to come back.

    ``suspects``: ranks (about their current generation) or ``(rank, generation)`` pairs; a suspicion about
    an older generation is old news and ignored.  ``backs``: rank -> the generation a dead worker asked to
    come back as (one more than its current, at most ``max_returns``).  ``decided``: the board's
    decided-through mark; the view takes effect after it (a restarted shard 0 that resumes at an earlier round
    must not change a round it already declared final, and a worker stepping through rounds while dead is never
    past it)."""
    new = set()
    for s in suspects:
        r, g = (int(s), current.gen(s)) if isinstance(s, int) else (int(s[0]), int(s[1]))
        if g == current.gen(r) and r not in current.dead:
            new.add(r)
    # a return waits until the current view is in effect: trees rebuilt twice within VIEW_LAG_ROUNDS put the
    # PS shards out of step for rounds (a round without the worker, then at once one with it: the returning
    # worker's first round met its peers' relays late, cut them as stragglers, and the shards dropped them)
    back = {int(r) for r, g in (backs or {}).items()
            if int(r) in current.dead and int(g) == current.gen(r) + 1 <= min(max_returns, RETURNS_LIMIT)} \
        if round_ >= current.from_round else set()
    if not new and not back:
        return None
    start = max(decided_through(round_), decided + 1)
    rets = {r: (g, since) for r, g, since in current.returns}
    for r in back:
        rets[r] = (current.gen(r) + 1, start)
    return TreeView(current.number + 1, start, (current.dead | new) - back,
                    tuple(sorted((r, g, since) for r, (g, since) in rets.items())))


class Suspicion:
    """Misses in a row per worker peer (sans-IO); a peer becomes a suspect once."""

    def __init__(self, max_missed: int):
        if max_missed < 1:
            raise ValueError(f"max_missed must be >= 1, got {max_missed}")
        self.max_missed = max_missed
        self._missed: dict[int, int] = {}
        self._gen: dict[int, int] = {}  # rank -> the generation the counts are about
        self.suspects: dict[int, str] = {}  # rank -> why (about its generation in ``gen_of``)

    def gen_of(self, rank: int) -> int:
        return self._gen.get(rank, 0)

    def observe(self, rank: int, ok: bool, why: str = "", *, fatal: bool = False, gen: int = 0) -> bool:
        """Record one exchange with worker ``rank`` of generation ``gen``; True when it became a suspect now.

        ``fatal``: the transport reported the peer gone (closed or unreachable): a suspect at once.  A newer
        generation (the worker came back) starts from a clean slate; news about an older one is ignored."""
        if gen < self._gen.get(rank, 0):
            return False
        if gen > self._gen.get(rank, 0):
            self._gen[rank] = gen
            self._missed.pop(rank, None)
            self.suspects.pop(rank, None)
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


def _by_rank(suspicions: Mapping) -> dict[int, str]:
    out: dict[int, str] = {}
    for (r, _g), why in sorted(suspicions.items()):
        out.setdefault(r, why)
    return out


class MemoryBoard:
    """A board in memory, shared by the processes of an in-memory job (tests, simulations)."""

    def __init__(self):
        self._suspicions: dict[tuple, str] = {}
        self._backs: dict[int, int] = {}
        self._view: TreeView | None = None
        self._stop: int | None = None
        self._decided = -1

    def suspect(self, rank: int, by: str, why: str, gen: int = 0) -> None:
        self._suspicions.setdefault((int(rank), int(gen)), f"{by}: {why}")

    def suspicions(self) -> dict[tuple, str]:
        """``(rank, generation) -> why`` of every suspicion posted."""
        return dict(self._suspicions)

    def ask_back(self, rank: int, gen: int) -> None:
        """Worker ``rank``, declared dead, asks to come back as generation ``gen``."""
        self._backs[int(rank)] = max(self._backs.get(int(rank), 0), int(gen))

    def backs(self) -> dict[int, int]:
        """rank -> the highest generation it asked to come back as."""
        return dict(self._backs)

    def post_decided(self, round_: int) -> None:
        self._decided = max(self._decided, int(round_))

    def decided(self) -> int:
        return self._decided

    def suspects(self) -> dict[int, str]:
        """rank -> why, any generation (the first posted)."""
        return _by_rank(self._suspicions)

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

    def look(self) -> tuple:
        """``(decided, stop, newest view)``: see :meth:`StoreBoard.look`."""
        return self._decided, self._stop, self._view


def _rank_ok(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


class StoreBoard:
    """A board on the job's ``TCPStore`` (every value signed with the job's secret; bad entries are skipped).

    Keys (under the job's prefix): ``tree/suspects`` (a counter) and ``tree/suspect/<i>``; ``tree/backs`` (a
    counter) and ``tree/back/<i>``; ``tree/views`` (a counter) and ``tree/view/<n>``; ``tree/decided``;
    ``tree/stop``.  Every read is one store round trip: a ``compare_set`` that cannot match (:data:`_PEEK`)
    answers the value, or the sentinel for a missing key, where ``check`` + ``get`` take three (``get`` waits for
    the key first).  Over a 200 ms path to the store a worker's look at the board took 1.2-2.0 s that way, longer
    than its round; :meth:`look` now takes two round trips when no view is new."""

    def __init__(self, store, secret: bytes, log=None):
        self.store, self.secret = store, secret
        self.log = log or (lambda msg: None)
        self._entries_seen: dict[str, int] = {}  # kind -> the counter's value at the last read
        self._entries_waiting: dict[str, set] = {}  # kind -> numbers taken whose entries were not written yet
        self._suspicions: dict[tuple, str] = {}
        self._backs: dict[int, int] = {}
        self._n_views = 0
        self._view: TreeView | None = None
        self._decided = -1  # the highest decided-through mark seen or written (it only grows)
        self.rejected = 0  # entries not signed with the job's secret or malformed: skipped

    def _put(self, key: str, d: dict) -> None:
        from .schedule_cli import _sign

        self.store.set(key, _sign(self.secret, d))

    def _peek(self, key: str) -> bytes | None:
        """The raw value of ``key``, None if it is missing (one store round trip, never waits)."""
        v = self.store.compare_set(key, _PEEK, _PEEK)
        return None if v == _PEEK.encode() else v

    def _get(self, key: str) -> dict | None:
        """The signed entry ``key``; None if it is missing, or not signed with the job's secret (counted)."""
        raw = self._peek(key)
        return None if raw is None else self._verified(raw, key)

    def _verified(self, raw: bytes, key: str) -> dict | None:
        from .errors import RendezvousError
        from .schedule_cli import _verify

        try:
            return _verify(self.secret, raw, key)
        except (RendezvousError, ValueError, TypeError) as exc:
            self.rejected += 1
            self.log(f"[tree-views] skipped {key}: {exc}")
            return None

    def suspect(self, rank: int, by: str, why: str, gen: int = 0) -> None:
        i = self.store.add("tree/suspects", 1)
        self._put(f"tree/suspect/{i}", {"rank": int(rank), "by": by, "why": why, "gen": int(gen)})

    def _new_entries(self, kind: str):
        """The signed entries ``tree/<kind>/<i>`` added since the last call (``tree/<kind>s`` counts them).  An
        entry whose number was taken but which is not written yet (its writer is between the two) is read again
        next time, not skipped."""
        n = self.store.add(f"tree/{kind}s", 0)
        seen, waiting = self._entries_seen.get(kind, 0), self._entries_waiting.setdefault(kind, set())
        todo = sorted(waiting) + list(range(seen + 1, min(n, MAX_VIEW_RANKS * (RETURNS_LIMIT + 1)) + 1))
        self._entries_seen[kind] = max(seen, n)
        for i in todo:
            key = f"tree/{kind}/{i}"
            raw = self._peek(key)
            if raw is None:
                waiting.add(i)
                continue
            waiting.discard(i)
            d = self._verified(raw, key)
            if d is not None:
                yield d

    def suspicions(self) -> dict[tuple, str]:
        """``(rank, generation) -> why`` of every suspicion posted (entries not signed or malformed: skipped)."""
        for d in self._new_entries("suspect"):
            if _rank_ok(d.get("rank")) and _rank_ok(d.get("gen", 0)):
                self._suspicions.setdefault((d["rank"], d.get("gen", 0)), f"{d.get('by')}: {d.get('why')}")
        return dict(self._suspicions)

    def suspects(self) -> dict[int, str]:
        """rank -> why, any generation (the first posted)."""
        return _by_rank(self.suspicions())

    def ask_back(self, rank: int, gen: int) -> None:
        i = self.store.add("tree/backs", 1)
        self._put(f"tree/back/{i}", {"rank": int(rank), "gen": int(gen)})

    def backs(self) -> dict[int, int]:
        """rank -> the highest generation it asked to come back as."""
        for d in self._new_entries("back"):
            if _rank_ok(d.get("rank")) and _rank_ok(d.get("gen")):
                self._backs[d["rank"]] = max(self._backs.get(d["rank"], 0), d["gen"])
        return dict(self._backs)

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
        return self._view_number(self.store.add("tree/views", 0))

    def _view_number(self, n: int) -> TreeView | None:
        """The newest view, reading view ``n`` if it is newer than the one held."""
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
            # with the number of views published so far (shard 0 is their only author): a reader of the mark
            # knows every view of the rounds it covers without reading the views counter (:meth:`look`)
            self._put("tree/decided", {"round": int(round_), "views": self._n_views})
            self._decided = int(round_)

    def decided(self) -> int:
        """The decided-through mark (-1 before shard 0 has posted one)."""
        self._read_decided()
        return self._decided

    def _read_decided(self) -> int | None:
        """Read the mark; returns the number of views published when it was posted (None: not known)."""
        d = self._get("tree/decided")
        if d is None:
            return None
        r, n = d.get("round"), d.get("views")
        if not _rank_ok(r):
            self.rejected += 1
            self.log(f"[tree-views] skipped tree/decided: {d!r} is not a round")
            return None
        self._decided = max(self._decided, r)
        return n if _rank_ok(n) else None

    def look(self) -> tuple:
        """``(decided, stop, newest view)`` for a worker about to run a round: two store round trips when no view
        is new.  The mark carries the number of views published before it (:meth:`post_decided`), and a view
        published later changes only rounds after the mark, so the view read holds every round up to
        ``decided``."""
        n = self._read_decided()
        stop = self.stopped_at()
        return self._decided, stop, (self.latest() if n is None else self._view_number(n))

    def post_stop(self, round_: int) -> None:
        self.store.set("tree/stop", json.dumps(int(round_)))

    def clear_stop(self) -> None:
        """Forget a ``stop`` an earlier incarnation of the PS posted (a restarted PS runs on)."""
        try:
            self.store.delete_key("tree/stop")
        except (AttributeError, RuntimeError):  # a store without delete: overwrite with "none"
            self.store.set("tree/stop", json.dumps(None))

    def stopped_at(self) -> int | None:
        raw = self._peek("tree/stop")
        if raw is None:
            return None
        try:
            v = json.loads(raw)
            return None if v is None else int(v)
        except (ValueError, TypeError):
            return None
