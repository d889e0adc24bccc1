"""Hoplite's asynchronous parameter server: half-batch updates (§6.3 of the paper).

Theory of operation
-------------------
The paper's asynchronous PS "collects and reduces the updates from the first
half of worker nodes that finish and broadcasts the new weights back to these
nodes", while the other half keep computing.  :class:`AsyncHalfBatchController`
does that with Hoplite's two primitives, sans-IO, over many overlapping
updates:

* **Update ``u``** is a :class:`~ltp_ps.schedules.hoplite.HopliteController`
  used for its reduce only (slots suffixed ``@u``).  Its chain's inputs are
  every live worker; workers join it in the order their gradients become
  ready (receiver-driven chain, §4.3).  Once ``quota`` of them
  (``ceil(n/2)``, :func:`half_batch`) are chained the update's membership is
  *met*: the other inputs are *excused* (not missed: they join update
  ``u + 1``, opened at that moment) and the chain closes into the PS.
* **Staleness bound** (the paper has none; our choice): a gradient computed
  on version ``v`` and applied by update ``u`` has staleness ``u - v``.  When
  update ``u`` meets its quota, an input whose next gradient would reach
  staleness ``> max_staleness`` in update ``u + 1`` is *overdue* and is not
  excused: ``u`` waits for it (or its death).  Hence every applied gradient
  has staleness ``<= max_staleness`` (:data:`MAX_STALENESS`).
* **Apply order**: update ``u``'s Combine + Apply grants on the PS are held
  until update ``u - 1`` is applied, so version ``u + 1`` is always the PS
  parameters after updates ``0..u``.  An update whose every chained input
  died still gets an Apply (of nothing), so versions never skip.
* **Version ``v``'s broadcast**: when the PS reports :class:`UpdateApplied`
  for update ``v - 1``, a second HopliteController (slots ``@v``: the PS
  sends from its snapshot of version ``v``) broadcasts it, receiver-driven
  (§4.2-4.3), to that update's live members only.  A member starting to
  fetch ``v`` is *retired* from older versions' directories (its copy is
  about to be overwritten; a transfer it already serves runs first, its
  grants being ordered).  Version 0 goes to every worker at :meth:`start`.

* **Taking a worker back** (:meth:`AsyncHalfBatchController.admit`; ours,
  the paper has no faults): a worker written off (``NodeFailed``: paused, cut off) that joins
  again is live again at once (the quota counts it) and gets the next
  version broadcast with that update's members.  Its first gradient is
  *parked* until an update that has it as an input opens (updates open with
  the live workers of their moment), then chained like any other; one that
  would be staler than ``max_staleness`` there is dropped (counted
  ``parked_too_stale``) and the worker waits for the next version instead.

Events: ``NodeReady(w, version=v)`` (w's gradient on version ``v``; one
that is not the version the controller expects from ``w`` is dropped and
counted), ``ChunkArrived(w, key="params:k@v")``, ``TransferDone`` (routed by
the tag: its phase says broadcast or reduce, its iteration field the version
or update), ``NodeFailed``, :class:`UpdateApplied`.  Nothing here reads a
clock or draws randomness other than from the seeded ``rng``.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Sequence

from .hoplite import CHUNK_BYTES, PAPER_LATENCY_S, STALL_TIMEOUT_S, HopliteController
from .program import Apply, ChunkArrived, Controller, Grant, NodeFailed, NodeReady, TransferDone
from .tags import PHASE_PULL, PHASE_PUSH, unpack

__all__ = ["MAX_STALENESS", "half_batch", "UpdateApplied", "AsyncHalfBatchController", "params_key",
           "parse_params_key", "batch_of_slot"]

MAX_STALENESS = 2  # updates: the most a gradient may lag the update that applies it (our bound; see above)


def half_batch(n: int) -> int:
    """The paper's "first half of the workers": ``ceil(n / 2)`` gradients per update (at least 1)."""
    return max(1, -(-int(n) // 2))


def params_key(shard: int, version: int) -> str:
    """The object name of version ``version`` of shard ``shard``'s parameters (``ChunkArrived.key``)."""
    return f"params:{int(shard)}@{int(version)}"


def parse_params_key(key: str) -> tuple[int, int] | None:
    """``(shard, version)`` of a :func:`params_key`, else None."""
    head, sep, v = str(key).partition("@")
    if not sep or not v.isdigit() or not head.startswith("params:") or not head[7:].isdigit():
        return None
    return int(head[7:]), int(v)


def batch_of_slot(slot: str) -> int | None:
    """The update a PS slot of this mode belongs to (``acc@u``, ``in@u:...``), else None."""
    _, sep, tail = str(slot).partition("@")
    u = tail.split(":", 1)[0]
    return int(u) if sep and u.isdigit() else None


@dataclasses.dataclass(frozen=True)
class UpdateApplied:
    """The PS applied update ``batch`` to shard ``shard`` (fed back by the PS role after its Apply)."""

    batch: int
    shard: int = 0


class AsyncHalfBatchController(Controller):
    """Asynchronous half-batch PS updates through Hoplite's reduce chains and broadcasts (see the module doc).

    ``quota``: gradients per update (default :func:`half_batch` of the live workers); ``max_staleness``:
    the staleness bound in updates; ``updates``: :meth:`done` after that many updates are applied."""

    def __init__(self, shards: Sequence[tuple[int, int]], *, quota: int | None = None,
                 max_staleness: int = MAX_STALENESS, updates: int | None = None, elem_bytes: int = 4,
                 bandwidth_bps: float = 10e9, latency_s: float = PAPER_LATENCY_S, rng: random.Random | None = None,
                 chunk_bytes: int = CHUNK_BYTES, stall_timeout_s: float = STALL_TIMEOUT_S):
        if not shards:
            raise ValueError("the asynchronous Hoplite PS needs at least one PS shard (the reduce receiver)")
        if quota is not None and quota < 1:
            raise ValueError(f"quota must be >= 1 gradient per update (got {quota})")
        if max_staleness < 1:
            raise ValueError(f"max_staleness must be >= 1 update (got {max_staleness}); 0 would be BSP: use "
                             f"--mode bsp")
        self.shards = [tuple(s) for s in shards]
        self.quota_override = quota
        self.max_staleness = int(max_staleness)
        self.updates = updates
        self._kw = dict(elem_bytes=elem_bytes, bandwidth_bps=bandwidth_bps, latency_s=latency_s,
                        chunk_bytes=chunk_bytes, stall_timeout_s=stall_timeout_s)
        self.rng = rng or random.Random(0)
        self.chunk_bytes = chunk_bytes
        self.elem_bytes = elem_bytes
        self.stall_timeout_s = stall_timeout_s
        self.nodes: list = []
        self.live: set = set()
        self.fresh: dict = {}  # worker -> the version its next gradient is (or will be) computed on
        self.batches: dict = {}  # update u -> HopliteController (its reduce), until applied
        self.met: set = set()  # updates whose quota is met (their non-overdue pending inputs were excused)
        self.versions: dict = {}  # version v -> HopliteController (its broadcast), until every receiver has it
        self.open = 0  # the newest update (the one late gradients join)
        self.applied = 0  # updates applied so far (= the PS's newest version)
        self._applied_shards: set = set()
        self._held: dict = {}  # update -> Apply grants waiting for the previous update's apply
        self._empty_sent: set = set()
        self.staleness: dict = {}  # update -> {worker: staleness of its gradient}
        self.returning: set = set()  # workers taken back, waiting for the next version broadcast
        self.parked: dict = {}  # worker -> version of a gradient waiting for an update that has it as an input
        self.counters = {"stale_ready": 0, "unknown_tag": 0, "excused": 0, "overdue_waits": 0, "taken_back": 0,
                         "parked": 0, "parked_too_stale": 0}

    # -- Controller interface -------------------------------------------------
    def start(self, iteration: int, nodes: Sequence[str], *, now: float) -> list[Grant]:
        self.nodes = [n for n in nodes if not n.startswith("server:")]
        self.live = set(self.nodes)
        self.fresh = {n: 0 for n in self.nodes}
        self.open = 0
        self._new_batch(0, now)
        return self._broadcast(0, self.nodes, now)

    def quota(self) -> int:
        """Gradients an update waits for: the override, else half the live workers (never more than live)."""
        q = self.quota_override if self.quota_override is not None else half_batch(len(self.live))
        return max(1, min(q, len(self.live))) if self.live else 1

    def on_event(self, event, *, now: float) -> list[Grant]:
        """One event; the grants to run now (none once :meth:`done`: the run is over, STOP follows)."""
        if self.done():
            return []
        out = self._on_event(event, now)
        return [] if self.done() else out

    def _on_event(self, event, now: float) -> list[Grant]:
        if isinstance(event, NodeReady):
            return self._ready(event.node, event.version, now)
        if isinstance(event, ChunkArrived):
            kv = parse_params_key(event.key)
            ctl = self.versions.get(kv[1]) if kv else None
            if ctl is None:
                return []
            out = ctl.on_event(ChunkArrived(event.node, f"params:{kv[0]}", event.lo, event.hi, event.complete),
                               now=now)
            return out + self._gc_versions()
        if isinstance(event, TransferDone):
            try:
                t = unpack(event.tag)
            except ValueError:
                self.counters["unknown_tag"] += 1
                return []
            if t.phase == PHASE_PULL and t.iteration in self.versions:
                out = self.versions[t.iteration].on_event(event, now=now)
                return out + self._gc_versions()
            if t.phase == PHASE_PUSH and t.iteration in self.batches:
                return self._after(t.iteration, self.batches[t.iteration].on_event(event, now=now), now)
            self.counters["unknown_tag"] += 1
            return []
        if isinstance(event, NodeFailed):
            return self._failed(event, now)
        if isinstance(event, UpdateApplied):
            return self._applied_update(event, now)
        return []

    def next_deadline(self) -> float | None:
        if self.done():
            return None
        ds = [d for c in self.versions.values() if (d := c.next_deadline()) is not None]
        return min(ds) if ds else None

    def on_timer(self, *, now: float) -> list[Grant]:
        if self.done():
            return []
        out = []
        for v in sorted(self.versions):
            out += self.versions[v].on_timer(now=now)
        return out

    def done(self) -> bool:
        return self.updates is not None and self.applied >= self.updates

    # -- updates (reduce) -------------------------------------------------------
    def _new_batch(self, u: int, now: float) -> None:
        ctl = HopliteController(self.shards, rng=random.Random(self.rng.random()), auto_get=False,
                                suffix=f"@{u}", **self._kw)
        ctl.start(u, sorted(self.live), now=now)
        self.batches[u] = ctl
        self.open = u

    def _ready(self, node: str, version: int, now: float) -> list[Grant]:
        if node not in self.live or self.fresh.get(node) != version:
            self.counters["stale_ready"] += 1
            return []
        u = next((b for b in sorted(self.batches) if node in self.batches[b].reduce.pending()), None)
        if u is None:  # a worker taken back since the open update began: it waits for the next one
            self.parked[node] = version
            self.counters["parked"] += 1
            return []
        ctl = self.batches[u]
        self.fresh[node] = u + 1
        self.staleness.setdefault(u, {})[node] = u - version
        out = ctl.ready_grants(node) + ctl._hop_grants(ctl.reduce.ready(node, now=now))
        return self._after(u, out, now)

    def _overdue(self, u: int, node: str) -> bool:
        """``node``'s next gradient would be staler than the bound if it joined update ``u + 1``."""
        return u + 1 - self.fresh.get(node, 0) > self.max_staleness

    def _check_quota(self, u: int, now: float) -> list[Grant]:
        ctl = self.batches.get(u)
        if ctl is None or u in self.met:
            return []
        rc = ctl.reduce
        if len([n for n in rc.ready_nodes if n not in rc.dead]) < self.quota() and rc.pending():
            return []
        self.met.add(u)
        if u == self.open:
            self._new_batch(u + 1, now)
        out = []
        for n in rc.pending():
            if self._overdue(u, n):
                self.counters["overdue_waits"] += 1
                continue
            self.counters["excused"] += 1
            out += ctl._hop_grants(rc.excuse(n, now=now))
        return out + self._unpark(now)

    def _unpark(self, now: float) -> list[Grant]:
        """Chain parked gradients into the newest update, which has every live worker as an input; one that
        would be staler than the bound there is dropped and its worker gets the next version instead."""
        u = self.open
        ctl = self.batches.get(u)
        if ctl is None:
            return []
        out = []
        for node, version in sorted(self.parked.items()):
            if node not in ctl.reduce.pending():
                continue
            del self.parked[node]
            if node not in self.live or self.fresh.get(node) != version:
                continue
            if u - version > self.max_staleness:
                self.counters["parked_too_stale"] += 1
                self.returning.add(node)
                continue
            out += self._ready(node, version, now)
        return out
    def _after(self, u: int, grants: list, now: float) -> list[Grant]:
        """Post-process update ``u``'s grants: quota, held applies, and the apply of an update that closed
        with nothing to deliver."""
        out = self._hold_applies(u, grants) + self._check_quota(u, now)
        ctl = self.batches.get(u)
        if ctl is not None and ctl.reduce.closed and not ctl.reduce.final_ok and u not in self._empty_sent:
            self._empty_sent.add(u)  # every chained input died: an Apply of nothing keeps versions in step
            out += self._hold_applies(u, [Grant(f"server:{k}", (self._empty_apply(u, lo, hi),),
                                                reason="hoplite async: empty update")
                                          for k, (lo, hi) in enumerate(self.shards)])
        return out

    def _empty_apply(self, u, lo, hi) -> Apply:
        return Apply(self.batches[u].acc_slot, lo, hi)

    def _hold_applies(self, u: int, grants: list) -> list[Grant]:
        out = []
        for g in grants:
            if u != self.applied and any(s.op == "apply" for s in g.steps):
                self._held.setdefault(u, []).append(g)
            else:
                out.append(g)
        return out

    # -- versions (broadcast) ---------------------------------------------------
    def _broadcast(self, v: int, receivers, now: float) -> list[Grant]:
        receivers = [n for n in receivers if n in self.live]
        if not receivers:
            return []
        ctl = HopliteController(self.shards, rng=random.Random(self.rng.random()), auto_get=False,
                                suffix=f"@{v}", **self._kw)
        ctl.start(v, receivers, now=now)
        self.versions[v] = ctl
        out = []
        for n in receivers:
            for old, c in self.versions.items():
                if old < v:
                    for b in c.broadcasts:
                        b.retire(n)
            self.fresh[n] = v
            out += ctl.get(n, now=now)
        return out

    def _gc_versions(self) -> list[Grant]:
        for v in [v for v, c in self.versions.items() if all(b.done() for b in c.broadcasts)]:
            del self.versions[v]
        return []

    def live_versions(self) -> set:
        """Versions still being broadcast (the PS keeps their snapshots)."""
        return set(self.versions)

    def _applied_update(self, ev: UpdateApplied, now: float) -> list[Grant]:
        if ev.batch != self.applied:
            return []
        self._applied_shards.add(ev.shard)
        if len(self._applied_shards) < len(self.shards):
            return []
        self._applied_shards = set()
        u = ev.batch
        self.applied = u + 1
        ctl = self.batches.pop(u)
        members = [n for n in ctl.reduce.ready_nodes if n in self.live]
        back = sorted(n for n in self.returning if n in self.live and n not in members)
        self.returning.clear()
        out = self._broadcast(u + 1, members + back, now)
        out += self._held.pop(u + 1, [])
        return out

    # -- faults -------------------------------------------------------------------
    def admit(self, node: str, *, now: float) -> list[Grant]:
        """Take worker ``node`` back (written off by ``NodeFailed`` and joined again; the driver's ``revive``):
        live at once, it gets the next version broadcast (see the module doc).  No grants until then."""
        if node.startswith("server:") or node in self.live or self.done():
            return []
        self.live.add(node)
        if node not in self.nodes:
            self.nodes.append(node)
        self.fresh[node] = None  # no version yet: a gradient it reports before the next one is stale
        self.returning.add(node)
        self.counters["taken_back"] += 1
        return []

    def _failed(self, ev: NodeFailed, now: float) -> list[Grant]:
        if ev.node.startswith("server:") or ev.node not in self.live:
            return []
        self.live.discard(ev.node)
        self.returning.discard(ev.node)
        self.parked.pop(ev.node, None)
        out = []
        for v in sorted(self.versions):
            out += self.versions[v].on_event(ev, now=now)
        for u in sorted(self.batches):
            out += self._after(u, self.batches[u].on_event(ev, now=now), now)
        for u in sorted(self.batches):  # fewer live workers: a smaller quota may be met now
            out += self._after(u, [], now)
        return out + self._gc_versions()

    # -- introspection ------------------------------------------------------------
    def contributions(self, u: int) -> set:
        """Workers whose gradient update ``u`` holds (after its chain closed)."""
        ctl = self.batches.get(u)
        return ctl.contributions() if ctl is not None else set()

    def members(self, u: int) -> list:
        ctl = self.batches.get(u)
        return list(ctl.reduce.ready_nodes) if ctl is not None else []
