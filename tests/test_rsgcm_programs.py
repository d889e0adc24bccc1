"""RSGCM plans compiled into round programs: matched transfers, and a reference interpreter showing every
worker ends with the same unbiased mean (with and without loss on the loss-tolerant reduce-scatter)."""

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ltp_ps.schedules.costmodel import Network
from ltp_ps.schedules.program import APPLY_AT_WORKERS, RELIABLE, TOLERANT
from ltp_ps.schedules.rsgcm import Action, RingPlan, RingSet, RsgcmPlanner, SearchParams, plan, programs
from ltp_ps.schedules.tags import PHASE_ALL_GATHER, PHASE_REDUCE_SCATTER, unpack


class Part:
    """Reference partial over ``[lo, hi)``: sum, count and the set of contributors (bitmask) per element."""

    def __init__(self, lo, hi, s=None, c=None, w=None):
        self.lo, self.hi = lo, hi
        n = hi - lo
        self.sum = np.zeros(n) if s is None else s
        self.cnt = np.zeros(n, dtype=np.int64) if c is None else c
        self.who = np.zeros(n, dtype=np.int64) if w is None else w

    def slice(self, lo, hi):
        a, b = lo - self.lo, hi - self.lo
        return Part(lo, hi, self.sum[a:b].copy(), self.cnt[a:b].copy(), self.who[a:b].copy())


def get(slots, name, lo, hi):
    """The executor's PartialSet.get: the exact range, else a slice of a covering partial, else None."""
    parts = slots.get(name, {})
    if (lo, hi) in parts:
        return parts[(lo, hi)]
    for (a, b), p in parts.items():
        if a <= lo and hi <= b:
            return p.slice(lo, hi)
    return None


def run_programs(rp, grads, *, loss_rng=None, loss_p=0.0):
    """Drive every node's stages with the executor's slot semantics until all finish (deadlock fails).

    ``Compute`` puts the gradient as one partial; Send takes ``get(slot, lo, hi)``
    (a tolerant send may lose a random sub-range: zero sum, zero count, no
    contributors, as ``Partial.drop_ranges``); Recv stores the partial under
    its exact range; Combine merges (asserting no contributor is counted twice)
    and stores under its exact range; Adopt records the mean; Apply the ranges.
    """
    nodes = sorted(rp.programs)
    n = len(next(iter(grads.values())))
    slots = {nd: {} for nd in nodes}
    mailbox = {}
    at = {nd: 0 for nd in nodes}
    sent = {nd: -1 for nd in nodes}
    adopted = {nd: {} for nd in nodes}
    applied = {nd: [] for nd in nodes}
    progress = True
    while progress:
        progress = False
        for nd in nodes:
            stages = rp.program(nd).stages
            if at[nd] >= len(stages):
                continue
            stage = stages[at[nd]]
            if sent[nd] < at[nd]:
                for s in stage:
                    if s.op == "send":
                        src = get(slots[nd], s.slot, s.lo, s.hi)
                        assert src is not None, f"{nd} sends [{s.lo},{s.hi}) of {s.slot} it does not hold"
                        part = src.slice(s.lo, s.hi)
                        if s.mode == TOLERANT and loss_rng is not None and loss_rng.random() < loss_p:
                            a = loss_rng.randrange(0, s.hi - s.lo)
                            b = loss_rng.randrange(a, s.hi - s.lo) + 1
                            part.sum[a:b], part.cnt[a:b], part.who[a:b] = 0, 0, 0
                        key = (nd, s.peer, s.tag)
                        assert key not in mailbox
                        mailbox[key] = part
                sent[nd] = at[nd]
                progress = True
            if not all((s.peer, nd, s.tag) in mailbox for s in stage if s.op == "recv"):
                continue
            for s in stage:
                if s.op == "compute":
                    rank = int(nd.split(":")[1])
                    slots[nd] = {s.slot: {(0, n): Part(0, n, grads[nd].copy(), np.ones(n, dtype=np.int64),
                                                       np.full(n, 1 << rank, dtype=np.int64))}}
                elif s.op == "recv":
                    slots[nd].setdefault(s.slot, {})[(s.lo, s.hi)] = mailbox.pop((s.peer, nd, s.tag))
            for s in stage:
                if s.op == "combine":
                    src = get(slots[nd], s.src, s.lo, s.hi)
                    assert src is not None, f"{nd} combines [{s.lo},{s.hi}) of {s.src} it does not hold"
                    acc = get(slots[nd], s.dst, s.lo, s.hi)
                    if acc is None:
                        acc = src.slice(s.lo, s.hi)
                    else:
                        acc = acc.slice(s.lo, s.hi)
                        assert not np.any(acc.who & src.who), "a contribution counted twice"
                        acc.sum += src.sum
                        acc.cnt += src.cnt
                        acc.who |= src.who
                    slots[nd].setdefault(s.dst, {})[(s.lo, s.hi)] = acc
                elif s.op == "adopt":
                    src = get(slots[nd], s.slot, s.lo, s.hi)
                    assert src is not None
                    c = src.cnt
                    mean = np.where(c > 0, src.sum / np.maximum(c, 1), 0.0)
                    adopted[nd][(s.lo, s.hi)] = (mean, src.who.copy(), c.copy())
                elif s.op == "apply":
                    applied[nd].append((s.slot, s.lo, s.hi))
            at[nd] += 1
            progress = True
    stuck = [nd for nd in nodes if at[nd] < len(rp.program(nd).stages)]
    assert not stuck, f"deadlock: {stuck} never finished"
    assert not mailbox, f"messages nobody received: {list(mailbox)[:3]}"
    return adopted, applied


def assemble(adopted, n):
    mean, who, cnt = np.zeros(n), np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    covered = np.zeros(n, dtype=bool)
    for (lo, hi), (m, w, c) in adopted.items():
        assert not covered[lo:hi].any()
        covered[lo:hi] = True
        mean[lo:hi], who[lo:hi], cnt[lo:hi] = m, w, c
    assert covered.all()
    return mean, who, cnt


def check_round(rp, devices, n, seed, loss_p=0.0):
    rng = np.random.default_rng(seed)
    grads = {f"worker:{d}": rng.normal(size=n) for d in devices}
    rp.check()
    assert rp.apply_at == APPLY_AT_WORKERS
    adopted, applied = run_programs(rp, grads, loss_rng=random.Random(seed) if loss_p else None, loss_p=loss_p)
    results = {nd: assemble(a, n) for nd, a in adopted.items()}
    ref_mean, ref_who, ref_cnt = results[f"worker:{devices[0]}"]
    full = sum(1 << d for d in devices)
    stack = np.stack([grads[f"worker:{d}"] for d in devices])
    single_step = len(rp.notes["rsgcm"]["steps"]) == 1
    for nd, (mean, who, cnt) in results.items():
        assert applied[nd] == [("mean", 0, n)]
        np.testing.assert_array_equal(who, ref_who)  # every worker counts the same contributions
        np.testing.assert_array_equal(cnt, ref_cnt)
        if single_step:
            np.testing.assert_array_equal(mean, ref_mean)  # one ring per block: bit-identical updates
        else:
            # later steps' rings add the same partials in ring orders that differ: rounding may differ
            np.testing.assert_allclose(mean, ref_mean, rtol=1e-12, atol=1e-15)
    if not loss_p:
        assert (ref_who == full).all()
        np.testing.assert_allclose(ref_mean, stack.mean(axis=0), rtol=1e-12, atol=1e-12)
    # unbiased: the mean of exactly the contributions that were counted
    for e in range(n):
        members = [i for i, d in enumerate(devices) if ref_who[e] >> d & 1]
        assert ref_cnt[e] == len(members)
        want = stack[members, e].mean() if members else 0.0
        assert ref_mean[e] == pytest.approx(want, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("tl,tb", [(0.1, 0.01), (0.01, 0.1)])
def test_torus_plans_compile_and_reduce(tl, tb):
    net = Network.torus(3, 3, tl, tb)
    p = plan(net, 32, params=SearchParams(sets=2), rng=random.Random(0))
    rp = programs(p, 1000, iteration=5)
    check_round(rp, list(range(9)), 1000, seed=1)
    check_round(rp, list(range(9)), 1000, seed=2, loss_p=0.3)


def test_tags_and_modes():
    net = Network.torus(3, 3, 0.1, 0.01)  # the 2D-mesh: two steps, both blocks in both
    p = plan(net, 32, params=SearchParams(sets=2), rng=random.Random(0))
    assert len(p.steps) == 2
    rp = programs(p, 101, iteration=42)
    for node, prog in rp.programs.items():
        for s in prog.sends():
            t = unpack(s.tag)
            assert t.iteration == 42 and t.kind == 5
            assert t.phase in (PHASE_REDUCE_SCATTER, PHASE_ALL_GATHER)
            step = t.step // 9  # the stride is the device count
            # tolerant only in the first step that reduces a block; all-gathers always reliable
            assert s.mode == (TOLERANT if (t.phase == PHASE_REDUCE_SCATTER and step == 0) else RELIABLE)
    assert rp.notes["rsgcm"]["steps"] == p.ring_sets()
    assert rp.to_json()["schedule"] == "rsgcm"


def test_custom_node_names_and_tiny_models():
    ring = Action((RingSet(0, ((0, 1, 2, 3),)),))
    p = RingPlan((0, 1, 2, 3), 1, 16, (ring,), 1.0)
    rp = programs(p, 2, iteration=0, nodes={0: "worker:10", 1: "worker:11", 2: "worker:12", 3: "worker:13"})
    assert set(rp.programs) == {"worker:10", "worker:11", "worker:12", "worker:13"}
    rp.check()
    # 2 elements over a 4-ring: two chunks are empty and are skipped on both sides
    rp0 = programs(p, 2, iteration=0)
    check_round(rp0, [0, 1, 2, 3], 2, seed=3)
    with pytest.raises(ValueError, match="n_elems"):
        programs(p, -1, iteration=0)


def test_multi_step_partial_schedule():
    """A schedule whose first step leaves devices out (rings of 3 over 6), merged by a second step."""
    s1 = Action((RingSet(0, ((0, 1, 2), (3, 4, 5))),))
    s2 = Action((RingSet(0, ((0, 3), (1, 4), (2, 5))),))
    p = RingPlan(tuple(range(6)), 1, 48, (s1, s2), 1.0)
    check_round(programs(p, 37, iteration=1), list(range(6)), 37, seed=4)
    check_round(programs(p, 37, iteration=1), list(range(6)), 37, seed=5, loss_p=0.5)


def test_fallback_plan_compiles():
    net = Network.full_mesh(6, 1e-3, 1e-8)
    planner = RsgcmPlanner(net, 1e6, params=SearchParams(sets=2), rng=random.Random(0))
    planner.fail_device(2)
    fb = planner.current_plan()
    assert fb.source == "fallback"
    rp = programs(fb, 50, iteration=3)
    assert set(rp.programs) == {"worker:0", "worker:1", "worker:3", "worker:4", "worker:5"}
    check_round(rp, [0, 1, 3, 4, 5], 50, seed=6)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(3, 7), S=st.sampled_from([1, 2]), seed=st.integers(0, 1000), elems=st.integers(1, 60),
       loss=st.sampled_from([0.0, 0.4]))
def test_any_searched_plan_reduces_to_the_unbiased_mean(n, S, seed, elems, loss):
    r = random.Random(seed)
    edges = [(u, v) for u in range(n) for v in range(u + 1, n) if r.random() < 0.8]
    net = Network.from_edges(n, edges, 1e-4, 1e-8)
    planner = RsgcmPlanner(net, 1e6, params=SearchParams(sets=S, episodes=30), rng=random.Random(seed))
    planner.search()
    cands = planner.candidates(2)
    if not cands:
        return
    for p in cands:
        check_round(programs(p, elems, iteration=seed % 100), list(range(n)), elems, seed=seed, loss_p=loss)


# ---------------------------------------------------------------- through the real executor (in-memory transport)

class WorkerRole:
    """Worker-side handlers of a ring program (compute the gradient partial, adopt means, apply)."""

    def __init__(self, grad):
        self.grad = grad
        self.mean = np.full(grad.size, np.nan, np.float32)
        self.counts = np.zeros(grad.size, np.int64)
        self.applied = None

    def compute(self, step, slots):
        from ltp_ps.schedules.partial import Partial

        slots.clear_partials()
        slots.put_partial(step.slot, Partial.of_gradient(self.grad))

    def adopt(self, step, slots):
        p = slots.partial(step.slot, step.lo, step.hi)
        assert p is not None, f"piece [{step.lo},{step.hi}) never arrived"
        p.mean("unbiased", out=self.mean[step.lo:step.hi])
        self.counts[step.lo:step.hi] = p.counts()

    def apply(self, step, slots):
        self.applied = self.mean.copy()


def run_executor(rp, grads, *, loss, seed):
    import asyncio

    from ltp_ps.schedules.executor import Executor, Slots
    from ltp_ps.schedules.program import worker
    from ltp_ps.transport.memory import MemoryNetwork

    async def go():
        n = len(grads)
        net = MemoryNetwork(loss=loss, segment_size=64, seed=seed)
        eps = [net.endpoint() for _ in range(n)]
        addrs = {worker(r): eps[r].local_addr for r in range(n)}
        roles = [WorkerRole(g) for g in grads]
        exes = [Executor(eps[r], worker(r), addrs, timeout_s=5.0) for r in range(n)]
        await asyncio.gather(*(exes[r].run(rp.program(worker(r)), Slots(), roles[r], iteration=rp.iteration)
                               for r in range(n)))
        return roles

    return asyncio.run(go())


@pytest.mark.parametrize("tl,tb,loss", [(0.1, 0.01, 0.0), (0.1, 0.01, 0.05), (0.01, 0.1, 0.0), (0.01, 0.1, 0.05)])
def test_executor_runs_rsgcm_on_a_torus(tl, tb, loss):
    net = Network.torus(3, 3, tl, tb)
    p = plan(net, 32, params=SearchParams(sets=2), rng=random.Random(0))
    size = 500
    rng = np.random.default_rng(11)
    grads = [rng.standard_normal(size).astype(np.float32) for _ in range(9)]
    rp = programs(p, size, iteration=7, critical=lambda lo, hi: ((0, 1),) if lo == 0 else ())
    rp.check()
    roles = run_executor(rp, grads, loss=loss, seed=5)
    for r in roles[1:]:
        np.testing.assert_array_equal(r.counts, roles[0].counts)  # the same contributions everywhere
        if len(p.steps) == 1:
            np.testing.assert_array_equal(r.applied, roles[0].applied)
        else:
            np.testing.assert_allclose(r.applied, roles[0].applied, rtol=1e-5, atol=1e-6)
    counts = roles[0].counts
    assert counts.max() <= 9 and counts[0] == 9  # element 0 is critical
    if loss == 0:
        assert (counts == 9).all()
        np.testing.assert_allclose(roles[0].applied, np.mean(grads, axis=0), rtol=1e-5, atol=1e-6)
    assert (roles[0].applied[counts == 0] == 0).all()
