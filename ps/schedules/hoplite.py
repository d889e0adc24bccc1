"""Hoplite: an object directory, receiver-driven broadcast and dynamic reduce chains (Zhuang et al.).

Theory of operation
-------------------
Hoplite schedules collectives at run time, from the order in which objects
become ready, instead of from ranks.  Three parts, all sans-IO:

* :class:`ObjectDirectory` (§4.1): per object, its size and the locations
  holding it, each marked *partial* (being written) or *complete*.  A query
  returns **one** location -- a complete one if any, else a partial one
  (ties: the location published earliest) -- and removes it while it
  serves, so a node sends to one receiver at a time; the receiver puts it
  back when its transfer ends.  A query that finds nothing waits in FIFO
  order until a location is put back (a synchronous query).
* :class:`Broadcast` (§4.2-4.3): receiver-driven.  A receiver's ``get``
  queries the directory, fetches the object in :data:`CHUNK_BYTES` chunks
  from the location it got, and publishes itself as a partial location at
  once, so later receivers stream from partial copies (the paper's Fig 4).
* :class:`ReduceChain` (§4.3): the receiver chains the inputs in the order
  they become ready; the running sum stays at the newest input's node (the
  chain's *tail*), which is told to send it to the next input that becomes
  ready (arrivals a, d, c, b at receiver D: A->C, C->B, B->D).  The
  receiver's own input is added last, at the receiver.  When ``n B L > S``
  the inputs are split at random into ``~sqrt(n)`` subsets, each reduced by
  its own chain, and the subset results chained again in the order they
  complete; subsets recurse until ``m B L <= S`` (App. A:
  ``T_1d = S/B + (n-1) L``, ``T_2d = 2 S/B + 2 (sqrt(n) - 1) L``).

Faults (the paper leaves them to the framework; our choices, also in
``docs/schedules.md``):

1. A stalled broadcast sender (no chunk for :data:`STALL_TIMEOUT_S`) is
   dropped from the directory; its receiver re-queries and fetches only the
   chunks it is missing.  A receiver that dies gives its sender back.  Who
   stalled is decided per fetch: the *source* (the PS running this
   controller) never stalls, so a fetch from it that makes no progress is
   the receiver's doing (dead before anyone said so, or paused): the
   receiver is set aside and tried again after
   :data:`RECEIVER_HOLD_OFF` stall timeouts or as soon as it reports a
   chunk.  A partial copy that holds nothing its receiver lacks is starved
   behind its own upstream, not stalled: its receiver keeps waiting.
2. A reduce sender keeps its partial (``acc``) until the hop after the next
   one has succeeded.  If the node it sent to dies before forwarding, the
   sender takes its place again: it becomes the tail (to be chained to the
   next ready node, or the receiver when every input is accounted for) or
   re-sends to the dead node's successor.  Only the dead node's own input
   is lost.
3. A worker that dies before it was chained counts as *missed*; the round
   closes once every input is chained or missed, so a round with one dead
   worker closes with ``N - 1`` contributions and, through the partials'
   per-element counts, their exact mean.

:class:`HopliteController` is the schedule layer's
:class:`~ltp_ps.schedules.program.Controller` for a PS round: parameters are
broadcast from every shard (one object per shard), gradients reduced along a
chain whose tail sends shard ``k``'s range to ``server:k``.  Grants to one
node are one stage each and run in the order issued.  Nothing here reads a
clock: every call takes ``now``; partitions use a seeded ``random.Random``.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Hashable, Sequence

from .base import Schedule
from .fluid import Flow
from .program import (APPLY_AT_SERVER, RELIABLE, SLOT_ACC, SLOT_GRAD, SLOT_PARAMS, TOLERANT, Apply, ChunkArrived,
                      Combine, Controller, Forward, Grant, NodeFailed, NodeReady, Recv, RoundPlan, Send, TransferDone,
                      server)
from .tags import PHASE_PULL, PHASE_PUSH, pack

__all__ = [
    "CHUNK_BYTES", "STALL_TIMEOUT_S", "PAPER_LATENCY_S", "ObjectDirectory", "Broadcast", "ReduceChain",
    "HopliteController", "HopliteSchedule", "use_2d", "t_1d", "t_2d", "partition", "broadcast_flows",
    "reduce_flows", "chunk_slot", "parse_chunk_slot", "params_slot",
]

CHUNK_BYTES = 256 * 1024  # bytes per broadcast chunk (the choice; the paper pipelines 4 KB blocks)
REDUCE_PIECE_BYTES = 512 * 1024  # bytes per reduce piece: each piece has its own chain (cut-through reduce)
MAX_REDUCE_PIECES = 32  # pieces per shard at most (control messages grow with pieces x hops)
STALL_TIMEOUT_S = 0.5  # seconds without a chunk before a broadcast receiver gives up on its sender
RECEIVER_HOLD_OFF = 2  # stall timeouts a receiver set aside (its fetch from the source stalled) waits to be served
PAPER_LATENCY_S = 125e-6  # seconds: the paper's conservative point-to-point latency estimate (§6.1)
KIND_PARAMS = 2  # ltp_ps.wire.KIND_PARAMS
KIND_PARTIAL = 5  # ltp_ps.wire.KIND_PARTIAL
MAX_STEP = 4095  # tags.STEP_BITS: transfer sequence numbers wrap here


# --------------------------------------------------------------------------- App. A

def use_2d(n: int, size_bytes: float, bandwidth_bps: float, latency_s: float) -> bool:
    """§4.3: a two-dimensional chain when ``n B L > S`` (S in bits)."""
    return n * bandwidth_bps * latency_s > 8 * size_bytes


def t_1d(n: int, size_bytes: float, bandwidth_bps: float, latency_s: float) -> float:
    """App. A: a pipelined chain of ``n`` objects, ``S/B + (n-1) L`` seconds."""
    return 8 * size_bytes / bandwidth_bps + (n - 1) * latency_s


def t_2d(n: int, size_bytes: float, bandwidth_bps: float, latency_s: float) -> float:
    """App. A: ``2 T_1d(sqrt(n))``."""
    return 2 * t_1d(math.sqrt(n), size_bytes, bandwidth_bps, latency_s)


def partition(nodes: Sequence, rng: random.Random) -> list[list]:
    """Split ``nodes`` at random into ``round(sqrt(n))`` (at least 2) subsets of near-equal size."""
    nodes = list(nodes)
    rng.shuffle(nodes)
    k = max(2, round(math.sqrt(len(nodes))))
    return [nodes[i::k] for i in range(k) if nodes[i::k]]


# --------------------------------------------------------------------------- directory (§4.1)

class ObjectDirectory:
    """Per object: size and locations (partial/complete).  ``query`` hands out one location and removes
    it until ``put_back``; unanswered queries wait in FIFO order."""

    def __init__(self):
        self._size: dict = {}
        self._loc: dict = {}  # key -> {node: complete}, insertion order = publication order
        self._waiting: dict = {}  # key -> [receiver, ...]
        self._lent: dict = {}  # key -> {node: complete} (serving, out of the directory)

    def create(self, key: Hashable, size: int) -> None:
        if key in self._size and self._size[key] != size:
            raise ValueError(f"object {key!r} already exists with size {self._size[key]}, not {size}")
        self._size[key] = int(size)
        self._loc.setdefault(key, {})
        self._waiting.setdefault(key, [])
        self._lent.setdefault(key, {})

    def size(self, key) -> int:
        return self._size[key]

    def publish(self, key, node, *, complete: bool) -> None:
        """``node`` holds (or is about to hold) ``key``: add it, or update its completeness."""
        self._need(key)
        if node in self._lent[key]:
            self._lent[key][node] = self._lent[key][node] or complete
        else:
            self._loc[key][node] = self._loc[key].get(node, False) or complete

    def locations(self, key) -> dict:
        """``{node: complete}`` of the locations available now (not serving)."""
        self._need(key)
        return dict(self._loc[key])

    def query(self, key, receiver, *, exclude=()) -> Hashable | None:
        """One location for ``receiver`` (complete first, then partial; earliest published first), removed
        until :meth:`put_back`; None (and the receiver queued) if there is none."""
        self._need(key)
        locs = [(n, c) for n, c in self._loc[key].items() if n != receiver and n not in exclude]
        pick = next((n for n, c in locs if c), None)
        if pick is None and locs:
            pick = locs[0][0]
        if pick is None:
            if receiver not in self._waiting[key]:
                self._waiting[key].append(receiver)
            return None
        self._lent[key][pick] = self._loc[key].pop(pick)
        if receiver in self._waiting[key]:
            self._waiting[key].remove(receiver)
        return pick

    def put_back(self, key, node) -> None:
        """``node`` finished serving: it is a location again (with the completeness it has reached)."""
        self._need(key)
        if node in self._lent[key]:
            self._loc[key][node] = self._lent[key].pop(node)

    def forget(self, key, node) -> None:
        """``node`` is gone (dead or stalled): drop it everywhere."""
        self._need(key)
        self._loc[key].pop(node, None)
        self._lent[key].pop(node, None)
        if node in self._waiting[key]:
            self._waiting[key].remove(node)

    def waiting(self, key) -> list:
        return list(self._waiting.get(key, []))

    def _need(self, key):
        if key not in self._size:
            raise KeyError(f"unknown object {key!r}; create it first")


# --------------------------------------------------------------------------- broadcast (§4.2-4.3)

@dataclasses.dataclass
class Fetch:
    """One granted transfer of ``chunks`` of ``key`` from ``src`` to ``dst``."""

    key: Hashable
    src: Hashable
    dst: Hashable
    chunks: tuple
    seq: int
    started_s: float
    progress_s: float


class Broadcast:
    """Receiver-driven broadcast of one object from ``source`` (complete) to whoever calls :meth:`get`.

    Methods return the list of :class:`Fetch` transfers to start now."""

    def __init__(self, key, size: int, source, directory: ObjectDirectory | None = None, *,
                 chunk_bytes: int = CHUNK_BYTES, stall_timeout_s: float = STALL_TIMEOUT_S):
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be > 0")
        self.key, self.size, self.source = key, int(size), source
        self.dir = directory or ObjectDirectory()
        self.dir.create(key, size)
        self.dir.publish(key, source, complete=True)
        self.n_chunks = max(1, -(-self.size // chunk_bytes))
        self.chunk_bytes = chunk_bytes
        self.stall_timeout_s = stall_timeout_s
        self.have: dict = {source: set(range(self.n_chunks))}
        self.active: dict = {}  # dst -> Fetch
        self.suspect: set = set()
        self.dead: set = set()
        self.held: dict = {}  # receivers set aside after a stalled fetch from the source -> when to try them again
        self.log: list = []  # (event, details) in order, for tests and traces
        self._seq = 0

    def complete(self, node) -> bool:
        return len(self.have.get(node, ())) == self.n_chunks

    def missing(self, node) -> tuple:
        h = self.have.get(node, set())
        return tuple(i for i in range(self.n_chunks) if i not in h)

    def get(self, node, *, now: float) -> list[Fetch]:
        """``node`` wants the object."""
        if node in self.dead or self.complete(node) or node in self.active:
            return []
        self.have.setdefault(node, set())
        return self._try(node, now)

    def _downstream(self, node) -> set:
        """Receivers fetching from ``node``, directly or through other partial copies: never a source for it (a
        cycle of partial copies, each waiting for the other's chunks, would hold nothing until the stall bound;
        seen when a relay died and its receiver re-queried, and the only free location fetched from it)."""
        out, frontier = set(), [node]
        while frontier:
            n = frontier.pop()
            for dst, f in self.active.items():
                if f.src == n and dst not in out:
                    out.add(dst)
                    frontier.append(dst)
        return out

    def _try(self, node, now) -> list[Fetch]:
        src = self.dir.query(self.key, node, exclude=self.suspect | self.dead | self._downstream(node))
        if src is None:
            self.log.append(("wait", node))
            return []
        self._seq += 1
        f = Fetch(self.key, src, node, self.missing(node), self._seq, now, now)
        self.active[node] = f
        self.dir.publish(self.key, node, complete=False)  # a partial copy serves others at once (§4.2)
        self.log.append(("fetch", src, node, "complete" if self.complete(src) else "partial"))
        return [f]

    def on_chunk(self, node, chunk: int, *, now: float) -> list[Fetch]:
        if not 0 <= chunk < self.n_chunks:
            self.log.append(("bad_chunk", node, chunk))
            return []
        self.have.setdefault(node, set()).add(chunk)
        f = self.active.get(node)
        if f is not None:
            f.progress_s = now
        if self.complete(node):
            self.dir.publish(self.key, node, complete=True)
        if self.held.pop(node, None) is not None and f is None and not self.complete(node):
            return self._try(node, now)  # set aside, and alive after all: fetch the rest at once
        return []

    def on_done(self, src, dst, *, ok: bool, now: float) -> list[Fetch]:
        f = self.active.get(dst)
        if f is None or f.src != src:
            return []
        del self.active[dst]
        out = []
        if src not in self.dead and src not in self.suspect:
            self.dir.put_back(self.key, src)
        if not self.complete(dst) and dst not in self.dead:
            out += self._try(dst, now)  # a short transfer: fetch the rest elsewhere
        return out + self._serve_waiting(now)

    def on_timer(self, *, now: float) -> list[Fetch]:
        """Fetches without progress for the stall timeout: a receiver whose sender stalled re-queries and
        fetches only its missing chunks; a receiver that stalls a fetch from the source is set aside (the
        source serves the next one); a receiver whose partial source is starved behind its own upstream waits.
        Receivers set aside long enough are tried again."""
        out = []
        for dst, f in sorted(self.active.items(), key=lambda kv: kv[1].seq):
            if now - f.progress_s < self.stall_timeout_s:
                continue
            if f.src == self.source:
                self.log.append(("receiver stalled", f.src, dst))
                del self.active[dst]
                self.suspect.add(dst)  # its partial copy serves nobody this round
                self.dir.forget(self.key, dst)
                self.dir.put_back(self.key, f.src)
                self.held[dst] = now + RECEIVER_HOLD_OFF * self.stall_timeout_s
                continue
            if (f.src not in self.suspect and f.src not in self.dead
                    and not self.have.get(f.src, set()) - self.have.get(dst, set())):
                f.progress_s = now  # starved, not stalled: it has passed on all it holds
                continue
            self.log.append(("stalled", f.src, dst))
            self.suspect.add(f.src)
            self.dir.forget(self.key, f.src)
            del self.active[dst]
            out += self._try(dst, now)
        for node, when in sorted(self.held.items(), key=lambda kv: kv[1]):
            if when <= now:
                del self.held[node]
                if node not in self.active and not self.complete(node) and node not in self.dead:
                    out += self._try(node, now)
        return out + self._serve_waiting(now)

    def next_deadline(self) -> float | None:
        ds = [f.progress_s + self.stall_timeout_s for f in self.active.values()] + list(self.held.values())
        return min(ds) if ds else None

    def on_failed(self, node, *, now: float) -> list[Fetch]:
        self.dead.add(node)
        self.held.pop(node, None)
        self.dir.forget(self.key, node)
        out = []
        f = self.active.pop(node, None)
        if f is not None and f.src not in self.dead:
            self.dir.put_back(self.key, f.src)
        for dst, g in sorted(self.active.items(), key=lambda kv: kv[1].seq):
            if g.src == node:
                del self.active[dst]
                out += self._try(dst, now)
        return out + self._serve_waiting(now)

    def retire(self, node) -> None:
        """``node`` stops serving this object (its copy is about to be overwritten by a newer version, the
        asynchronous mode): it leaves the directory for good; a transfer it is already serving finishes (its
        grants run in issue order, before the overwrite)."""
        self.suspect.add(node)
        self.dir.forget(self.key, node)

    def done(self) -> bool:
        """Every receiver that asked holds the object or died, and nothing is in flight."""
        return not self.active and all(self.complete(n) or n in self.dead for n in self.have)

    def _serve_waiting(self, now) -> list[Fetch]:
        out = []
        for r in self.dir.waiting(self.key):
            if r in self.active or self.complete(r) or r in self.dead:
                continue
            got = self._try(r, now)
            if not got:
                break
            out += got
        return out

    def chunk_range(self, i: int) -> tuple[int, int]:
        """Byte range of chunk ``i``."""
        return i * self.chunk_bytes, min(self.size, (i + 1) * self.chunk_bytes)


# --------------------------------------------------------------------------- reduce chains (§4.3)

@dataclasses.dataclass
class Hop:
    """A granted reduce transfer: ``src`` sends its running sum to ``dst`` (``final``: dst is the receiver)."""

    src: Hashable
    dst: Hashable
    seq: int
    final: bool = False


class _Chain:
    """One 1D chain over ``members`` (nodes, or sub-chains whose result counts as one input)."""

    def __init__(self, members, parent=None):
        self.members = list(members)
        self.parent = parent
        self.tail = None  # node holding this chain's running sum
        self.accounted: set = set()  # members chained or missed
        self.done = False


class ReduceChain:
    """Dynamic reduce of ``inputs`` into ``receiver`` (whose own input, if ``receiver_input``, is added last).

    ``ready(node)`` / ``failed(node)`` / ``hop_done(src, dst, ok)`` return the :class:`Hop` transfers to
    start now.  ``contents[node]`` is the set of inputs the node's running sum holds (bookkeeping that
    the fault rules and tests rely on)."""

    def __init__(self, inputs: Sequence, receiver, *, receiver_input: bool = False, size_bytes: float = 0.0,
                 bandwidth_bps: float = 10e9, latency_s: float = PAPER_LATENCY_S,
                 rng: random.Random | None = None, two_d: bool | None = None):
        self.inputs = [x for x in inputs if x != receiver]
        if len(set(self.inputs)) != len(self.inputs):
            raise ValueError("reduce inputs must be distinct nodes")
        self.receiver = receiver
        self.receiver_input = receiver_input
        self.rng = rng or random.Random(0)
        self._seq = 0
        self.hops: list[Hop] = []
        self.contents: dict = {}
        self.passed: dict = {}  # src -> nodes its completed hops reached (carries a late-reported hop onward)
        self.pred: dict = {}  # dst -> src of the latest hop into dst (the src keeps its sum for it)
        self.in_flight: dict = {}  # (src, dst) -> Hop
        self.outgoing: dict = {}  # src -> Hop it is sending (not yet done)
        self.dead: set = set()
        self.missed: set = set()
        self.excused: set = set()  # inputs let go before they were ready (asynchronous mode: a later reduce)
        self.ready_nodes: list = []
        self.deferred: dict = {}  # src -> hops granted once its incoming hop is done
        self.closed = False
        self.final_ok = False
        self.receiver_ready = not receiver_input
        n = len(self.inputs)
        want_2d = use_2d(n, size_bytes, bandwidth_bps, latency_s) if two_d is None else two_d
        self._leaf_chain: dict = {}
        self.root = self._build(self.inputs, None, want_2d, size_bytes, bandwidth_bps, latency_s, depth=0)
        self.dimensions = self._depth(self.root)

    def _build(self, members, parent, split, S, B, L, depth):
        if split and len(members) >= 4 and depth < 8:
            c = _Chain([], parent)
            for sub in partition(members, self.rng):
                again = (len(sub) * B * L > 8 * S) if S else False
                c.members.append(self._build(sub, c, again, S, B, L, depth + 1))
            return c
        c = _Chain(members, parent)
        for m in members:
            self._leaf_chain[m] = c
        return c

    def _depth(self, c) -> int:
        subs = [m for m in c.members if isinstance(m, _Chain)]
        return 1 + max((self._depth(s) for s in subs), default=0)

    def subsets(self) -> list[list]:
        """The leaf chains' members (one list for a 1D chain)."""
        out = []

        def walk(c):
            if all(not isinstance(m, _Chain) for m in c.members):
                out.append(list(c.members))
            for m in c.members:
                if isinstance(m, _Chain):
                    walk(m)
        walk(self.root)
        return out

    # -- events ---------------------------------------------------------------
    def ready(self, node, *, now: float = 0.0) -> list[Hop]:
        """``node``'s input is ready; the hops to start now."""
        return self._release(self._ready(node))

    def excuse(self, node, *, now: float = 0.0) -> list[Hop]:
        """``node`` (an input not ready yet) will not contribute to this reduce: it is accounted like a missed
        input but is not lost (the asynchronous mode chains it into a later reduce).  The hops to start now."""
        if (self.closed or node in self.dead or node not in self._leaf_chain or node in self.ready_nodes
                or node in self.excused):
            return []
        self.excused.add(node)
        return self._release(self._miss(self._leaf_chain[node], node))

    def pending(self) -> list:
        """Inputs neither ready, excused, missed nor dead (the ones this reduce still waits for)."""
        return [n for n in self.inputs if n not in self.ready_nodes and n not in self.excused
                and n not in self.missed and n not in self.dead]

    def _ready(self, node) -> list[Hop]:
        if self.closed or node in self.dead or node in self.excused:
            return []
        if node == self.receiver:
            self.receiver_ready = True
            return self._maybe_close()
        if node not in self._leaf_chain or node in self.ready_nodes:
            return []
        self.ready_nodes.append(node)
        self.contents[node] = {node}
        return self._arrive(self._leaf_chain[node], node, member=node)

    def _arrive(self, chain: _Chain, holder, member) -> list[Hop]:
        """``member``'s input (held at node ``holder``) is ready in ``chain``."""
        chain.accounted.add(id(member) if isinstance(member, _Chain) else member)
        out = []
        if chain.tail is None:
            chain.tail = holder
        else:
            out.append(self._hop(chain.tail, holder))  # the tail sends to the newest arrival
            chain.tail = holder
        return out + self._maybe_complete(chain)

    def _miss(self, chain: _Chain, member) -> list[Hop]:
        chain.accounted.add(id(member) if isinstance(member, _Chain) else member)
        return self._maybe_complete(chain)

    def _maybe_complete(self, chain: _Chain) -> list[Hop]:
        keys = {id(m) if isinstance(m, _Chain) else m for m in chain.members}
        if chain.done or not keys <= chain.accounted:
            return []
        chain.done = True
        if chain.parent is None:
            return self._maybe_close()
        if chain.tail is None:
            return self._miss(chain.parent, chain)
        return self._arrive(chain.parent, chain.tail, chain)

    def _maybe_close(self) -> list[Hop]:
        if not self.root.done or not self.receiver_ready or self.closed:
            return []
        if self.root.tail is None:  # nothing to deliver (every input missed)
            self.closed = True
            return []
        if any(h.final for h in self.outgoing.values()):
            return []
        return [self._hop(self.root.tail, self.receiver, final=True)]

    def _hop(self, src, dst, final=False) -> Hop:
        self._seq += 1
        h = Hop(src, dst, self._seq, final)
        self.hops.append(h)
        self.in_flight[(src, dst)] = h
        self.outgoing[src] = h
        self.pred[dst] = src
        return h

    def _incoming(self, node) -> bool:
        return any(d == node for (_, d) in self.in_flight)

    def _release(self, hops: list) -> list[Hop]:
        """Hops whose sender is still receiving wait (``deferred``) until its incoming hop is combined."""
        out = []
        for h in hops:
            if self._incoming(h.src):
                self.deferred.setdefault(h.src, []).append(h)
            else:
                out.append(h)
        return out

    def _undefer(self, node) -> list[Hop]:
        if self._incoming(node):
            return []
        return [h for h in self.deferred.pop(node, []) if (h.src, h.dst) in self.in_flight]

    def hop_done(self, src, dst, *, ok: bool, now: float = 0.0) -> list[Hop]:
        """A hop ended.  On success ``dst`` has combined it (the controller grants the Combine first), so
        hops deferred behind it start now."""
        h = self.in_flight.pop((src, dst), None)
        if h is None:
            return []
        if self.outgoing.get(src) is h:
            del self.outgoing[src]
        if not ok:
            return self._release(self._lost_hop(h)) + self._undefer(dst)
        self._carry(dst, self.contents.get(src, set()))
        self.passed.setdefault(src, set()).add(dst)
        if h.final:
            self.closed = True
            self.final_ok = True
            return []
        return self._undefer(dst)

    def _carry(self, node, inputs: set) -> None:
        """``node``'s sum now holds ``inputs``, and so does every sum it already reached: a cut-through node
        combines its incoming hop before its continuation sends on, but the two hops' reports reach the
        controller from different nodes, in either order (the next hop's report first left the receiver's
        bookkeeping without the inputs it had indeed summed)."""
        stack, seen = [node], set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            self.contents[n] = self.contents.get(n, set()) | inputs
            stack += self.passed.get(n, ())

    def _lost_hop(self, h: Hop) -> list[Hop]:
        """A hop failed: if the sender is alive it tries again, else its predecessor re-sends."""
        if h.dst in self.dead:
            return self._reroute_from(h.src, h.dst)
        src = h.src if h.src not in self.dead else self._live_pred(h.src)
        if src is None:
            return self._maybe_close() if h.final else []
        return [self._hop(src, h.dst, h.final)]

    def failed(self, node, *, now: float = 0.0) -> list[Hop]:
        """``node`` died; the hops to start now (see the fault rules in the module docstring)."""
        if node in self.dead or self.closed:
            return []
        hops = self._failed(node)
        self.deferred.pop(node, None)
        out = self._release(hops)
        for n in list(self.deferred):
            out += self._undefer(n)
        return out

    def _failed(self, node) -> list[Hop]:
        self.dead.add(node)
        out = []
        if node == self.receiver:
            raise RuntimeError("the reduce receiver died; the round cannot close (restart the round elsewhere)")
        if node in self._leaf_chain and node not in self.ready_nodes:
            self.missed.add(node)
            return self._miss(self._leaf_chain[node], node)
        # hops into the dead node are lost; its predecessor takes over
        for (s, d), h in list(self.in_flight.items()):
            if d == node:
                self.in_flight.pop((s, d))
                if self.outgoing.get(s) is h:
                    del self.outgoing[s]
        # a hop out of the dead node is lost too: its receiver gets the predecessor's sum instead
        for (s, d), h in list(self.in_flight.items()):
            if s == node:
                self.in_flight.pop((s, d))
                self.outgoing.pop(s, None)
                src = self._live_pred(node)
                if src is not None:
                    out.append(self._hop(src, d, h.final))
                elif h.final:
                    self.root.tail = None
                    out += self._maybe_close()
                return out
        out += self._reroute_from(self.pred.get(node), node)
        return out

    def _live_pred(self, node):
        seen = set()
        p = self.pred.get(node)
        while p is not None and p in self.dead and p not in seen:
            seen.add(p)
            p = self.pred.get(p)
        return p if p is not None and p not in self.dead else None

    def _reroute_from(self, src, dead):
        """``dead`` held (or was receiving) the running sum: ``src`` (its live predecessor) replaces it as
        the tail of every chain whose tail it was."""
        src = src if src is None or src not in self.dead else self._live_pred(src)
        out = []
        for chain in self._chains():
            if chain.tail == dead:
                chain.tail = src
        if self.root.done:
            out += self._maybe_close()
        return out

    def _chains(self):
        out, stack = [], [self.root]
        while stack:
            c = stack.pop()
            out.append(c)
            stack += [m for m in c.members if isinstance(m, _Chain)]
        return out

    def lost(self) -> set:
        """Inputs that will not reach the receiver: missed before they were ready, or held only by a node
        that died (after close: every input not in :meth:`contributions`)."""
        return set(self.inputs) - self.contributions() - self.excused

    def contributions(self) -> set:
        """Inputs included in the receiver's result (after close)."""
        return set(self.contents.get(self.receiver, set())) | ({self.receiver} if self.receiver_input else set())


# --------------------------------------------------------------------------- the controller

def params_slot(shard: int) -> str:
    return f"{SLOT_PARAMS}:{server(shard)}"


def chunk_slot(shard: int, chunk: int) -> str:
    """The slot of broadcast chunk ``chunk`` of shard ``shard``'s parameters.  Raw payloads are sent as
    the whole buffer bound to their slot, so the role binds each chunk slot to that chunk's bytes (a view
    of the parameter buffer: elements ``[lo, hi)`` of the step), on the PS and on every worker."""
    return f"{params_slot(shard)}#{int(chunk)}"


def parse_chunk_slot(slot: str) -> tuple[int, int] | None:
    """``(shard, chunk)`` of a :func:`chunk_slot` name, else None."""
    head, sep, tail = slot.partition("#")
    if not sep or not tail.isdigit() or not head.startswith(f"{SLOT_PARAMS}:server:"):
        return None
    k = head.rsplit(":", 1)[-1]
    return (int(k), int(tail)) if k.isdigit() else None


class HopliteController(Controller):
    """A PS round the Hoplite way: per-shard receiver-driven parameter broadcast, then a reduce chain of
    the workers' gradients whose tail sends shard ``k``'s range to ``server:k``.

    Events: ``NodeReady(worker)`` -- its gradient is ready (joins the chain); ``ChunkArrived(worker,
    key=f"params:{k}", lo, hi)`` -- parameter bytes ``[lo, hi)`` of shard ``k`` arrived; ``TransferDone``
    -- a granted transfer ended (tags say which); ``NodeFailed``.  :meth:`get` -- a worker wants the
    parameters (issued for every node by :meth:`start` unless ``auto_get=False``)."""

    def __init__(self, shards: Sequence[tuple[int, int]], *, elem_bytes: int = 4, bandwidth_bps: float = 10e9,
                 latency_s: float = PAPER_LATENCY_S, rng: random.Random | None = None,
                 chunk_bytes: int = CHUNK_BYTES, stall_timeout_s: float = STALL_TIMEOUT_S, auto_get: bool = True,
                 suffix: str = "", reduce_piece_bytes: int | None = None, cut_through_hops: bool = False):
        if not shards:
            raise ValueError("Hoplite needs at least one PS shard (the reduce receiver)")
        self.shards = [tuple(s) for s in shards]
        self.elem_bytes = elem_bytes
        self.bandwidth_bps, self.latency_s = bandwidth_bps, latency_s
        self.rng = rng or random.Random(0)
        self.chunk_bytes = max(elem_bytes, chunk_bytes - chunk_bytes % elem_bytes)
        self.stall_timeout_s = stall_timeout_s
        self.auto_get = auto_get
        # ``suffix`` names this controller's slots apart from those of others running at once (the
        # asynchronous mode runs one per update): the accumulator and hop inputs, and the PS's source
        # chunk slots (a snapshot of that version's parameters).  "" in BSP rounds.
        self.suffix = suffix
        self.acc_slot = SLOT_ACC + suffix
        # ``reduce_piece_bytes`` (None: one chain over every shard's range, store-and-forward per hop): the
        # gradients are reduced in pieces of about this many bytes, each by its own chain over the same
        # arrivals, so a node sends piece j on while it still receives piece j + 1 (cut-through; see
        # :meth:`_pieces`).  Apply is granted once every piece's chain closed.
        self.reduce_piece_bytes = reduce_piece_bytes
        # ``cut_through_hops`` (pieces only): a hop out of a node still receiving its incoming hop is granted at
        # once as a *continuation* (``Grant.after`` = that receive's slot), so the node combines and sends on the
        # moment the receive ends, without a round trip through the controller per hop and piece (see
        # :meth:`_continuations`).  Off: the hop waits for the receive's TransferDone and a Combine grant.
        self.cut_through_hops = cut_through_hops
        self._cont: dict = {}  # (chain, hop seq) -> slot of the incoming receive its continuation waits for
        self._continued_in: set = set()  # (chain, hop seq) of incoming hops whose Combine rides on a continuation
        self._hop_attempt: dict = {}  # (chain, hop seq) -> transfer number of its tags and receive slot
        self.superseded = 0  # hops that ended well after a failure had replaced them (not combined)
        self.iteration = 0
        self.broadcasts: list[Broadcast] = []
        self.reduce: ReduceChain | None = None  # the first piece's chain (the only one without pieces)
        self.reduces: list[ReduceChain] = []  # one chain per piece
        self._chain_ranges: list[tuple] = []  # per chain: ((shard, lo, hi), ...) it reduces
        self._applied = False
        self._tags: dict = {}  # tag -> ("bcast", k, Fetch) | ("reduce", chain, Hop, range index)
        self._hop_pending: dict = {}  # (chain, hop seq) -> range indices whose transfer has not ended yet
        self._hop_slot: dict = {}  # (chain, hop seq) -> receive slot name
        self._attempt = 0

    # -- Controller interface -------------------------------------------------
    def start(self, iteration: int, nodes: Sequence[str], *, now: float) -> list[Grant]:
        self.iteration = iteration
        self.nodes = [n for n in nodes if not n.startswith("server:")]
        self._tags.clear()
        self._hop_pending.clear()
        self._hop_slot.clear()
        self._cont.clear()
        self._continued_in.clear()
        self._hop_attempt.clear()
        d = ObjectDirectory()
        self.broadcasts = [Broadcast(f"params:{k}", (hi - lo) * self.elem_bytes, server(k), d,
                                     chunk_bytes=self.chunk_bytes, stall_timeout_s=self.stall_timeout_s)
                           for k, (lo, hi) in enumerate(self.shards)]
        size = sum(hi - lo for lo, hi in self.shards) * self.elem_bytes
        self._chain_ranges = self._pieces()
        self._applied = False
        if len(self._chain_ranges) == 1:
            rngs = [self.rng]
        else:  # every piece's chain draws the same 2D partition (the same arrivals make the same hops)
            seed = self.rng.random()
            rngs = [random.Random(seed) for _ in self._chain_ranges]
        self.reduces = [ReduceChain(self.nodes, "PS", size_bytes=size, bandwidth_bps=self.bandwidth_bps,
                                    latency_s=self.latency_s, rng=r) for r in rngs]
        self.reduce = self.reduces[0]
        out = []
        if self.auto_get:
            for n in self.nodes:
                out += self.get(n, now=now)
        return out

    def _pieces(self) -> list[tuple]:
        """The reduce's chains, each as the ``(shard, lo, hi)`` ranges it carries: one chain over every shard
        without ``reduce_piece_bytes``; else each shard cut into ``ceil(bytes / reduce_piece_bytes)`` near-equal
        pieces (at most ``MAX_REDUCE_PIECES``), one chain each."""
        whole = [tuple((k, lo, hi) for k, (lo, hi) in enumerate(self.shards))]
        if not self.reduce_piece_bytes:
            return whole
        per = max(1, self.reduce_piece_bytes // self.elem_bytes)
        out = []
        for k, (lo, hi) in enumerate(self.shards):
            n = hi - lo
            p = min(MAX_REDUCE_PIECES, max(1, -(-n // per)))
            cuts = [lo + n * i // p for i in range(p + 1)]
            out += [((k, a, b),) for a, b in zip(cuts, cuts[1:]) if b > a]
        return out if len(out) > 1 else whole

    def get(self, node: str, *, now: float) -> list[Grant]:
        out = []
        for k, b in enumerate(self.broadcasts):
            out += self._fetch_grants(k, b.get(node, now=now))
        return out

    def on_event(self, event, *, now: float) -> list[Grant]:
        if isinstance(event, NodeReady):
            if event.iteration != self.iteration or self.reduce is None or event.node not in self.nodes:
                return []
            if event.node in self.reduce.ready_nodes or event.node in self.reduce.dead:
                return []
            out = self.ready_grants(event.node)
            for c, rc in enumerate(self.reduces):
                out += self._hop_grants(rc.ready(event.node, now=now), c)
                out += self._continuations(c)
            return out + self._maybe_apply()
        if isinstance(event, ChunkArrived):
            k = self._shard_of_key(event.key)
            if k is None:
                return []
            b = self.broadcasts[k]
            lo_b, hi_b = (event.lo - self.shards[k][0]) * self.elem_bytes, (event.hi - self.shards[k][0]) * self.elem_bytes
            out = []
            for i in range(lo_b // b.chunk_bytes, -(-hi_b // b.chunk_bytes)):
                out += self._fetch_grants(k, b.on_chunk(event.node, i, now=now))
            return out
        if isinstance(event, TransferDone):
            what = self._tags.pop(event.tag, None)
            if what is None:
                return []
            if what[0] == "bcast":
                _, k, f = what
                return self._fetch_grants(k, self.broadcasts[k].on_done(f.src, f.dst, ok=event.ok, now=now))
            _, c, h, k = what
            rc = self.reduces[c]
            pend = self._hop_pending.get((c, h.seq))
            if pend is None:  # this hop already failed on another range
                return []
            if not event.ok:
                del self._hop_pending[(c, h.seq)]
                self._continued_in.discard((c, h.seq))  # its continuations were dropped at the node
                out = self._hop_grants(rc.hop_done(h.src, h.dst, ok=False, now=now), c)
                return out + self._continuations(c) + self._maybe_apply()
            pend.discard(k)
            if pend:
                return []
            del self._hop_pending[(c, h.seq)]
            if rc.in_flight.get((h.src, h.dst)) is not h:
                # superseded: its sender's death was handled first and the predecessor re-sent in its place, so
                # combining this copy as well would count the predecessor's inputs twice (only the dead node's own
                # gradient is lost).  A continuation on it may have combined it already; its hop is never re-sent.
                self._hop_slot.pop((c, h.seq), None)
                self._continued_in.discard((c, h.seq))
                self.superseded += 1
                return []
            if (c, h.seq) in self._continued_in:  # the node combined it itself, in the continuation
                self._continued_in.discard((c, h.seq))
                slot = self._hop_slot.pop((c, h.seq), None)
                out = []
            else:
                slot = None
                out = self._combine_grants(h, c)
            released = [x for x in rc.hop_done(h.src, h.dst, ok=True, now=now)
                        if slot is None or self._cont.get((c, x.seq)) != slot]  # already running as continuations
            return out + self._hop_grants(released, c) + self._continuations(c) + self._maybe_apply()
        if isinstance(event, NodeFailed):
            out = []
            for k, b in enumerate(self.broadcasts):
                out += self._fetch_grants(k, b.on_failed(event.node, now=now))
            if self.reduces and not event.node.startswith("server:"):
                for c, rc in enumerate(self.reduces):
                    out += self._hop_grants(rc.failed(event.node, now=now), c)
                    out += self._continuations(c)
                out += self._maybe_apply()
            return out
        return []

    def next_deadline(self) -> float | None:
        ds = [d for b in self.broadcasts if (d := b.next_deadline()) is not None]
        return min(ds) if ds else None

    def on_timer(self, *, now: float) -> list[Grant]:
        out = []
        for k, b in enumerate(self.broadcasts):
            out += self._fetch_grants(k, b.on_timer(now=now))
        return out

    def done(self) -> bool:
        return bool(self.reduces) and all(rc.closed for rc in self.reduces)

    def contributions(self) -> set:
        """Inputs in the receiver's result (with pieces: in at least one piece; the mean is per element)."""
        return set().union(*(rc.contributions() for rc in self.reduces)) if self.reduces else set()

    def short_pieces(self, counts, shard: int, offset: int) -> int:
        """Pieces of ``shard`` that lack, on every element, an input of a worker still alive: from the PS's
        per-element contribution ``counts`` (index ``i`` is element ``offset + i``), a piece whose largest count
        is below the number of live contributors.  That is an input lost on one piece's chain (a running sum
        held only by a node that died; the fault rules re-send it from the predecessor, so 0 unless they
        failed), or a piece whose final hop never arrived.  Not counted: a worker that died mid-round, whose
        own input reached some pieces and not others (the fault rules lose it by design), and a piece Early
        Close cut short, which keeps its full count on the packets that arrived (per-element loss,
        ``delivered``).  Measured on the data: hop reports may reach the PS after the round closed (the live
        count, from them, can then only be low, which never makes a piece short)."""
        if counts.size == 0:
            return 0
        dead = set().union(*(rc.dead for rc in self.reduces))
        need = min(int(counts.max()), len(self.contributions() - dead))
        return sum(1 for ranges in self._chain_ranges for k, lo, hi in ranges
                   if k == shard and hi > lo and counts[lo - offset:hi - offset].max() < need)

    # -- grants -----------------------------------------------------------------
    def _shard_of_key(self, key) -> int | None:
        if isinstance(key, str) and key.startswith("params:") and key[7:].isdigit() and int(key[7:]) < len(self.shards):
            return int(key[7:])
        return None

    def _tag(self, phase, seq, chunk, kind) -> int:
        return pack(self.iteration, phase, seq % (MAX_STEP + 1), chunk, kind)

    def _fetch_grants(self, k: int, fetches) -> list[Grant]:
        out = []
        lo, hi = self.shards[k]
        per = self.chunk_bytes // self.elem_bytes
        for f in fetches:
            sends, recvs = [], []
            for i in f.chunks:
                a, b = lo + i * per, min(hi, lo + (i + 1) * per)
                tag = self._tag(PHASE_PULL, f.seq, i, KIND_PARAMS)
                slot = chunk_slot(k, i)
                if f.src == server(k):
                    sends.append(Send(f.dst, slot + self.suffix, a, b, tag, RELIABLE, "params"))
                else:
                    sends.append(Forward(f.dst, slot, a, b, tag, RELIABLE, "params"))
                recvs.append(Recv(f.src, slot, a, b, tag, RELIABLE, "params"))
            if not f.chunks:
                continue
            self._tags[self._tag(PHASE_PULL, f.seq, f.chunks[-1], KIND_PARAMS)] = ("bcast", k, f)
            out += [Grant(f.src, tuple(sends), reason=f"hoplite bcast {k} -> {f.dst}"),
                    Grant(f.dst, tuple(recvs), reason=f"hoplite bcast {k} <- {f.src}")]
        return out

    def _ranges(self, c: int) -> tuple:
        return self._chain_ranges[c] if self._chain_ranges else tuple(
            (k, lo, hi) for k, (lo, hi) in enumerate(self.shards))

    def _hop_grants(self, hops, c: int = 0, *, after: str | None = None) -> list[Grant]:
        """A hop of chain ``c``: the sender sends its running sum (per range of the chain), the receiver
        receives it.  The receiver's Combine is granted only once every range arrived
        (:meth:`_combine_grants`), so a hop from a sender that died half-way is never combined.

        ``after``: grant the sender's part as a continuation of its receive into that slot (Combine it, then
        send).  A hop granted before (a continuation whose incoming receive failed, granted again on the one
        that replaced it) keeps its tags and receive: only the sender's grant is issued again."""
        out = []
        ranges = self._ranges(c)
        for h in hops:
            a = self._hop_attempt.get((c, h.seq))
            fresh = a is None
            if fresh:
                self._attempt += 1
                a = self._hop_attempt[(c, h.seq)] = self._attempt
                self._hop_slot[(c, h.seq)] = f"in{self.suffix}:{h.src}:{a}"
                self._hop_pending[(c, h.seq)] = set(range(len(ranges)))
            slot = f"in{self.suffix}:{h.src}:{a}"
            sends, recvs, server_recvs = [], [], []
            for i, (k, lo, hi) in enumerate(ranges):
                tag = self._tag(PHASE_PUSH, a, i, KIND_PARTIAL)
                dst = server(k) if h.final else h.dst
                sends.append(Send(dst, self.acc_slot, lo, hi, tag, TOLERANT, "partial"))
                if not fresh:
                    continue
                self._tags[tag] = ("reduce", c, h, i)
                r = Recv(h.src, slot, lo, hi, tag, TOLERANT, "partial")
                if h.final:
                    server_recvs.append(Grant(server(k), (r,), reason=f"hoplite reduce <- {h.src}"))
                else:
                    recvs.append(r)
            where = "PS" if h.final else h.dst
            if after is None:
                out.append(Grant(h.src, tuple(sends), reason=f"hoplite reduce -> {where}"))
            else:
                combines = tuple(Combine(self.acc_slot, after, lo, hi) for _, lo, hi in ranges)
                out.append(Grant(h.src, combines + tuple(sends), reason=f"hoplite reduce -> {where} after {after}",
                                 after=after))
            out += server_recvs
            if recvs:
                out.append(Grant(h.dst, tuple(recvs), reason=f"hoplite reduce <- {h.src}"))
        return out

    def _continuations(self, c: int) -> list[Grant]:
        """Cut-through hops: every hop of chain ``c`` deferred behind its sender's one incoming hop is granted now
        as a continuation of that receive (once per incoming receive: if the receive fails the node drops the
        continuation, and the hop is granted again on the receive that replaces it).  The incoming hop's Combine
        then rides on the continuation (:meth:`on_event` grants none).  Chains of several ranges (no pieces) and
        senders with several incoming hops (2D chains) keep the round trip."""
        if not self.cut_through_hops or not self.reduces or len(self._ranges(c)) != 1:
            return []
        rc = self.reduces[c]
        out = []
        for src, hops in list(rc.deferred.items()):
            inc = [h for (s, d), h in rc.in_flight.items() if d == src]
            if src in rc.dead or len(inc) != 1 or (c, inc[0].seq) not in self._hop_slot:
                continue
            xslot = self._hop_slot[(c, inc[0].seq)]
            for h in hops:
                if rc.in_flight.get((h.src, h.dst)) is not h or self._cont.get((c, h.seq)) == xslot:
                    continue
                self._cont[(c, h.seq)] = xslot
                self._continued_in.add((c, inc[0].seq))
                out += self._hop_grants([h], c, after=xslot)
        return out

    def _combine_grants(self, h: Hop, c: int = 0) -> list[Grant]:
        slot = self._hop_slot.pop((c, h.seq))
        ranges = self._ranges(c)
        if h.final and len(self.reduces) <= 1:
            return [Grant(server(k), (Combine(self.acc_slot, slot, lo, hi), Apply(self.acc_slot, lo, hi)),
                          reason="hoplite apply") for k, lo, hi in ranges]
        if h.final:  # one piece is in: Apply waits for every chain (:meth:`_maybe_apply`)
            return [Grant(server(k), (Combine(self.acc_slot, slot, lo, hi),), reason="hoplite combine piece")
                    for k, lo, hi in ranges]
        return [Grant(h.dst, tuple(Combine(self.acc_slot, slot, lo, hi) for _, lo, hi in ranges),
                      reason="hoplite combine")]

    def _maybe_apply(self) -> list[Grant]:
        """With pieces: once every piece's chain closed and one delivered, each shard applies the pieces its
        Combines put in the accumulator (after them: grants to one node run in order)."""
        if len(self.reduces) <= 1 or self._applied or not self.done() or not any(rc.final_ok for rc in self.reduces):
            return []
        self._applied = True
        return [Grant(server(k), (Apply(self.acc_slot, lo, hi),), reason="hoplite apply")
                for k, (lo, hi) in enumerate(self.shards)]

    def ready_grants(self, node: str) -> list[Grant]:
        """A worker's first reduce grant once its gradient is computed: its sum starts as its gradient."""
        return [Grant(node, tuple(Combine(self.acc_slot, SLOT_GRAD, lo, hi) for lo, hi in self.shards),
                      reason="hoplite own gradient")]


# --------------------------------------------------------------------------- fluid flows (§6 experiments)

def broadcast_flows(source: str, receivers: Sequence[str], size_bytes: float, *, prefix="bcast") -> list[Flow]:
    """The flows of a broadcast in which every receiver asks at time 0, in order (the directory's decisions
    replayed with no transfer finishing before the last query): each receiver streams from the previous
    receiver's partial copy, a pipelined chain (``S/B + (n-1) L``)."""
    b = Broadcast("obj", int(size_bytes), source, chunk_bytes=max(1, int(size_bytes)))
    flows, feeding = [], {}
    for r in receivers:
        for f in b.get(r, now=0.0):
            up = feeding.get(f.src)
            flows.append(Flow((prefix, f.dst), f.src, f.dst, size_bytes, stream_from=up))
            feeding[f.dst] = (prefix, f.dst)
    # each receiver published itself as a partial copy before the next query, so nobody waits
    assert len(feeding) == len(set(receivers) - {source}), "a receiver found no location"
    return flows


def reduce_flows(inputs: Sequence[str], receiver: str, size_bytes: float, *, bandwidth_bps: float,
                 latency_s: float, rng: random.Random | None = None, prefix="reduce",
                 ready_order: Sequence[str] | None = None, ready_s: dict | None = None) -> list[Flow]:
    """The flows of a reduce with inputs ready in ``ready_order`` (default: ``inputs``; or sorted by
    ``ready_s``, seconds): a hop starts once its receiver is ready and streams from the hop into its
    sender (pipelined chains); a sub-chain's result joins its parent chain as the sub-chain completes."""
    rc = ReduceChain(inputs, receiver, size_bytes=size_bytes, bandwidth_bps=bandwidth_bps, latency_s=latency_s,
                     rng=rng or random.Random(0))
    ready_s = dict(ready_s or {})
    order = ready_order or (sorted(inputs, key=lambda n: (ready_s.get(n, 0.0), str(n))) if ready_s else inputs)
    for n in order:
        rc.ready(n)
    flows, into = [], {}
    for h in rc.hops:
        up = into.get(h.src)
        t0 = max(ready_s.get(h.src, 0.0), 0.0 if h.final else ready_s.get(h.dst, 0.0))
        flows.append(Flow((prefix, h.seq), h.src, h.dst, size_bytes, stream_from=up, not_before_s=t0))
        into[h.dst] = (prefix, h.seq)
    return flows


class HopliteSchedule(Schedule):
    """``--schedule hoplite``: dynamic; :meth:`controller` returns a :class:`HopliteController`.

    ``plan()`` gives the static part only: nothing (every transfer is granted at run time)."""

    name = "hoplite"
    apply_at = APPLY_AT_SERVER

    def plan(self, iteration: int) -> RoundPlan:
        return RoundPlan(self.name, iteration, {}, self.apply_at, {"dynamic": True})

    def predict_s(self, nbytes: int | None = None) -> float | None:
        """Fluid estimate of one round's communication: every shard's receiver-driven broadcast (all workers
        asking at once), then the gradients' reduce chain, ``S/B + (n-1) L`` each when pipelined."""
        if self.world.topology is None:
            return None
        from .fluid import FluidNetwork, simulate

        total = 4 * max(1, self.world.n_elems)
        scale = 1.0 if nbytes is None else nbytes / total
        topo = self.world.effective_topology()
        net = FluidNetwork.from_topology(topo)
        workers = self.world.worker_nodes
        bcast = []
        for k, (lo, hi) in enumerate(self.world.shards):
            bcast += broadcast_flows(server(k), workers, 4 * (hi - lo) * scale, prefix=("bcast", k))
        t_b = simulate(net, bcast).completion_s
        rate = min(h.up_bps for h in topo.hosts)
        red = reduce_flows(workers, server(0), total * scale, bandwidth_bps=rate, latency_s=net.latency_s,
                           rng=random.Random(0))
        return t_b + simulate(net, red).completion_s

    def _link(self) -> tuple[float, float]:
        """(bits/s, seconds): the slowest host rate and the largest round trip of the topology, else §6.1's."""
        topo = self.world.topology
        rate, lat = 10e9, PAPER_LATENCY_S
        if topo is not None and topo.hosts:
            rate = min(h.up_bps for h in topo.hosts)
            lat = max(2 * h.latency_s for h in topo.hosts)
        return rate, lat

    def controller(self) -> HopliteController:
        rate, lat = self._link()
        return HopliteController(self.world.shards, bandwidth_bps=rate, latency_s=lat,
                                 rng=random.Random(self.rng.random()), reduce_piece_bytes=REDUCE_PIECE_BYTES,
                                 cut_through_hops=True)

    def async_controller(self, *, updates: int | None = None, quota: int | None = None, max_staleness=None):
        """``--mode async``: :class:`~ltp_ps.schedules.hoplite_async.AsyncHalfBatchController` (half-batch
        updates of the paper's §6.3 asynchronous PS)."""
        from .hoplite_async import MAX_STALENESS, AsyncHalfBatchController

        rate, lat = self._link()
        return AsyncHalfBatchController(self.world.shards, quota=quota, updates=updates,
                                        max_staleness=MAX_STALENESS if max_staleness is None else max_staleness,
                                        bandwidth_bps=rate, latency_s=lat, rng=random.Random(self.rng.random()))


SCHEDULE = HopliteSchedule
