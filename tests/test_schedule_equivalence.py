"""Every schedule, run by the executor over the in-memory transport with seeded loss, yields exactly the direct
unbiased mean of the contributions that arrived (the property of issue 9 §1).

Gradients are decodable: worker ``w`` contributes ``10**w`` to every element, so ``mean * counts`` names which
workers' contributions reached each element; an :class:`Aggregator` fed the workers' gradients with exactly the
complementary losses must give the same mean.  Runs every registered schedule whose round is a static program.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ltp_ps.aggregate import Aggregator, bubbles_to_elements
from ltp_ps.schedules import Topology, World, availability, create
from ltp_ps.schedules.executor import Executor, Slots
from ltp_ps.schedules.partial import Partial
from ltp_ps.schedules.program import APPLY_AT_WORKERS, parse_node
from ltp_ps.transport.memory import MemoryNetwork
from ltp_ps.wire import HEADER_BYTES, GradHeader

STATIC = [n for n, why in availability().items() if why is None and n not in ("mlfabric", "hoplite")]


class Role:
    """Generic handlers: raw (direct) and partial payloads, workers and PS shards."""

    def __init__(self, node, n, grad=None):
        self.node, self.n, self.grad = node, n, grad
        self.mean = np.full(n, np.nan, np.float32)
        self.counts = np.full(n, -1, np.int64)

    def compute(self, step, slots):
        slots.clear_partials()
        slots.put_partial(step.slot, Partial.of_gradient(self.grad))
        _, rank = parse_node(self.node)
        for name, buf in slots.buffers.items():
            if name.startswith("out:server:"):
                lo, hi = slots.ranges[name]
                GradHeader(rank, 0, 0, 0, 1, 0.0).pack_into(buf)
                buf[HEADER_BYTES:HEADER_BYTES + 4 * (hi - lo)].view(np.float32)[:] = self.grad[lo:hi]

    def combine(self, step, slots):  # a raw gradient message (direct)
        r = slots.reports.get(step.src)
        if r is None or r.received_bytes == 0 or not r.critical_complete:
            return
        n = step.hi - step.lo
        buf = slots.buffers[step.src]
        lost = bubbles_to_elements(r.bubbles, offset=HEADER_BYTES, n_elems=n)
        p = Partial.of_gradient(buf[HEADER_BYTES:HEADER_BYTES + 4 * n].view(np.float32).copy(), lost, lo=step.lo)
        acc = slots.partial(step.dst, step.lo, step.hi)
        if acc is None:
            slots.put_partial(step.dst, p)
        else:
            acc.merge(p)

    def adopt(self, step, slots):
        p = slots.partial(step.slot, step.lo, step.hi)
        assert p is not None, f"{self.node}: [{step.lo},{step.hi}) never arrived"
        self.mean[step.lo:step.hi] = p.mean()
        self.counts[step.lo:step.hi] = p.counts()

    def apply(self, step, slots):
        if step.slot == "mean":
            return  # workers-apply schedules: Adopt already recorded the reduced ranges
        p = slots.partial(step.slot, step.lo, step.hi)
        assert p is not None, f"{self.node}: nothing to apply on [{step.lo},{step.hi})"
        self.mean[step.lo:step.hi] = p.mean()
        self.counts[step.lo:step.hi] = p.counts()


def _bind_raw(plan, node, slots, n):
    """Buffers for raw-payload slots (parameters, notes, direct's gradients), sized for the largest range."""
    slots.ranges = {}
    for s in plan.program(node).steps():
        if s.op in ("send", "recv", "forward") and s.payload != "partial":
            if s.slot not in slots.buffers:
                slots.bind(s.slot, np.zeros(HEADER_BYTES + 4 * n, np.uint8))
            slots.ranges[s.slot] = (s.lo, s.hi)


async def run_schedule(name, n_workers, n_shards, loss, seed, size, topology=None):
    net = MemoryNetwork(loss=loss, segment_size=64, seed=seed)
    world = World(workers=range(n_workers), n_elems=size, layout=((0, size),), topology=topology,
                  shards=tuple((i * size // n_shards, (i + 1) * size // n_shards) for i in range(n_shards)))
    sched = create(name, world)
    plan = sched.plan(0)
    plan.check()
    nodes = sorted(plan.programs)
    eps = {n: net.endpoint() for n in nodes}
    addrs = {n: e.local_addr for n, e in eps.items()}
    roles, runs = {}, []
    for node in nodes:
        role, idx = parse_node(node)
        grad = np.full(size, float(10 ** idx), np.float32) if role == "worker" else None
        roles[node] = Role(node, size, grad)
        slots = Slots()
        _bind_raw(plan, node, slots, size)
        ex = Executor(eps[node], node, addrs, timeout_s=3.0)
        runs.append(ex.run(plan.program(node), slots, roles[node]))
    await asyncio.gather(*runs)
    return sched, plan, roles


def check(roles, n_workers, size, apply_at):
    holders = [r for r in roles.values() if (r.counts >= 0).any()]
    if apply_at == APPLY_AT_WORKERS:
        assert len(holders) == n_workers
        for r in holders[1:]:
            np.testing.assert_array_equal(r.mean, holders[0].mean)
        mean, counts = holders[0].mean, holders[0].counts
    else:  # PS shards each hold their range
        mean = np.zeros(size, np.float32)
        counts = np.full(size, -1, np.int64)
        for r in holders:
            ok = r.counts >= 0
            mean[ok], counts[ok] = r.mean[ok], r.counts[ok]
    assert (counts >= 0).all(), "some range was reduced by nobody"
    total = np.rint(mean.astype(np.float64) * counts).astype(np.int64)
    agg = Aggregator(size)
    for w in range(n_workers):
        present = (total // 10 ** w) % 10 == 1
        agg.add(np.full(size, float(10 ** w), np.float32), [(int(i), int(i) + 1) for i in np.flatnonzero(~present)])
    np.testing.assert_array_equal(agg.counts(), counts)
    np.testing.assert_allclose(agg.result(), mean, rtol=1e-6)
    return counts


@pytest.mark.parametrize("name", STATIC)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(n_workers=st.integers(2, 5), n_shards=st.integers(1, 2), loss=st.sampled_from([0.0, 0.1, 0.3]),
       seed=st.integers(0, 10_000), size=st.integers(8, 200), racks=st.booleans())
def test_every_schedule_gives_the_direct_unbiased_mean(name, n_workers, n_shards, loss, seed, size, racks):
    topo = None
    if racks:
        n_hosts = n_shards + n_workers
        topo = Topology.uniform([f"h{i}" for i in range(n_hosts)], rate_bps=1e9,
                                racks=[n_hosts // 2, n_hosts - n_hosts // 2])
    try:
        sched, plan, roles = asyncio.run(run_schedule(name, n_workers, n_shards, loss, seed, size, topo))
    except ValueError as exc:  # a planner refusing a world it cannot plan (e.g. too few workers for rings)
        pytest.skip(f"{name} cannot plan {n_workers} workers: {exc}")
    counts = check(roles, n_workers, size, plan.apply_at)
    if loss == 0:
        assert (counts == n_workers).all()


def test_the_harness_detects_a_wrong_mean():
    """Guard: the check fails when a contribution is double counted."""
    sched, plan, roles = asyncio.run(run_schedule("ring", 3, 1, 0.0, 0, 12))
    r = roles["worker:0"]
    for x in roles.values():
        x.counts[:] = x.counts - 1  # claim one fewer contributor than the sum holds
    with pytest.raises(AssertionError):
        check(roles, 3, 12, plan.apply_at)
    del r, sched
