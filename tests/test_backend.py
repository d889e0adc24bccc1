"""The ``ltp`` torch.distributed backend, several ranks in one process (threads, a HashStore), real sockets."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

import ltp_ps  # noqa: F401  (registers the backend)
from ltp_ps import backend as B
from ltp_ps.errors import ConfigError

pytestmark = pytest.mark.torch


def make_groups(world, transport="ltp", algorithm="auto", timeout_s=20.0, schedule="auto"):
    store = dist.HashStore()
    pgs = [None] * world
    errs = []
    opts = B.BackendOptions(transport=transport, algorithm=algorithm, schedule=schedule)

    def mk(r):
        try:
            pgs[r] = B.LtpProcessGroup(dist.PrefixStore("g/", store), r, world,
                                       datetime.timedelta(seconds=timeout_s), options=opts)
        except Exception as exc:  # noqa: BLE001
            errs.append(exc)

    ths = [threading.Thread(target=mk, args=(r,)) for r in range(world)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    if errs:
        raise errs[0]
    return pgs


@pytest.fixture(params=["ltp", "tcp"])
def transport(request):
    return request.param


@pytest.fixture
def groups_factory():
    made = []

    def make(*a, **kw):
        pgs = make_groups(*a, **kw)
        made.extend(pgs)
        return pgs

    yield make
    for pg in made:
        pg.shutdown()


def run_all(pgs, fn):
    """Call ``fn(rank, pg)`` on every rank (each returns Work); wait for all; return the per-rank Works."""
    works = [fn(r, pg) for r, pg in enumerate(pgs)]
    for w in works:
        w.wait()
    return works


def ar_opts(op):
    o = dist.AllreduceOptions()
    o.reduceOp = op
    return o


def test_import_registers_the_backend():
    assert "ltp" in dist.Backend.backend_list
    assert dist.Backend.backend_capability["ltp"] == ["cpu"]
    B.register()  # idempotent
    assert dist.Backend.backend_list.count("ltp") == 1


@pytest.mark.parametrize("algorithm", ["direct", "ring"])
@pytest.mark.parametrize("world", [2, 3])
def test_allreduce_every_op(groups_factory, transport, algorithm, world):
    pgs = groups_factory(world, transport, algorithm)
    ins = [torch.arange(1, 26, dtype=torch.float64) * (r + 1) - 3 * r for r in range(world)]
    refs = {dist.ReduceOp.SUM: sum(ins[1:], ins[0].clone()), dist.ReduceOp.PRODUCT: torch.stack(ins).prod(0),
            dist.ReduceOp.MIN: torch.stack(ins).min(0).values, dist.ReduceOp.MAX: torch.stack(ins).max(0).values,
            dist.ReduceOp.AVG: sum(ins[1:], ins[0].clone()) / world}
    for op, want in refs.items():
        ts = [t.clone() for t in ins]
        run_all(pgs, lambda r, pg: pg.allreduce([ts[r]], ar_opts(op)))
        for t in ts:
            assert torch.equal(t, want), (op, t, want)
    ints = [torch.tensor([0b1100, 0b1010, 7]) + r for r in range(world)]
    ts = [t.clone() for t in ints]
    run_all(pgs, lambda r, pg: pg.allreduce([ts[r]], ar_opts(dist.ReduceOp.BXOR)))
    want = ints[0].clone()
    for t in ints[1:]:
        want ^= t
    assert all(torch.equal(t, want) for t in ts)


def test_float_allreduce_replicas_bit_identical_and_close(groups_factory, transport):
    pgs = groups_factory(3, transport, "ring")
    g = torch.Generator().manual_seed(0)
    ins = [torch.randn(200_003, generator=g) for _ in range(3)]
    ts = [t.clone() for t in ins]
    run_all(pgs, lambda r, pg: pg.allreduce([ts[r]]))
    assert torch.equal(ts[0], ts[1]) and torch.equal(ts[1], ts[2])
    torch.testing.assert_close(ts[0], (ins[0].double() + ins[1].double() + ins[2].double()).float())


def test_other_collectives(groups_factory, transport):
    world = 3
    pgs = groups_factory(world, transport)
    # broadcast from the last rank, several tensors
    ts = [[torch.full((4,), float(r)), torch.arange(3) * r] for r in range(world)]
    o = dist.BroadcastOptions()
    o.rootRank = 2
    run_all(pgs, lambda r, pg: pg.broadcast(ts[r], o))
    for t in ts:
        assert torch.equal(t[0], torch.full((4,), 2.0)) and torch.equal(t[1], torch.arange(3) * 2)
    # allgather and all_gather_single
    outs = [[torch.empty(2) for _ in range(world)] for _ in range(world)]
    run_all(pgs, lambda r, pg: pg.allgather([outs[r]], [torch.tensor([r, 10.0 * r])]))
    for o_r in outs:
        assert [x.tolist() for x in o_r] == [[r, 10.0 * r] for r in range(world)]
    single = [torch.empty(world * 2) for _ in range(world)]
    run_all(pgs, lambda r, pg: pg.all_gather_single(single[r], torch.tensor([r, -r], dtype=torch.float32)))
    assert all(s.tolist() == [0.0, 0.0, 1.0, -1.0, 2.0, -2.0] for s in single)
    # reduce_scatter (list and single)
    rs = [torch.empty(3) for _ in range(world)]
    run_all(pgs, lambda r, pg: pg.reduce_scatter([rs[r]],
                                                 [[torch.full((3,), float(100 * j + r)) for j in range(world)]]))
    for j, t in enumerate(rs):
        assert t.tolist() == [float(300 * j + 0 + 1 + 2)] * 3
    rss = [torch.empty(2) for _ in range(world)]
    run_all(pgs, lambda r, pg: pg.reduce_scatter_single(rss[r], torch.arange(6, dtype=torch.float32) + r))
    for j, t in enumerate(rss):
        assert t.tolist() == [3 * (2 * j) + 3, 3 * (2 * j + 1) + 3]
    # alltoall
    a_out = [[torch.empty(1) for _ in range(world)] for _ in range(world)]
    run_all(pgs, lambda r, pg: pg.alltoall(a_out[r], [torch.tensor([10.0 * r + j]) for j in range(world)]))
    for r in range(world):
        assert [x.item() for x in a_out[r]] == [10.0 * j + r for j in range(world)]
    # barrier
    run_all(pgs, lambda r, pg: pg.barrier())
    # send/recv: two messages with one tag arrive in send order
    got = [torch.empty(5), torch.empty(5)]
    w1 = pgs[1].recv([got[0]], 0, 3)
    w2 = pgs[1].recv([got[1]], 0, 3)
    s1 = pgs[0].send([torch.full((5,), 1.0)], 1, 3)
    s2 = pgs[0].send([torch.full((5,), 2.0)], 1, 3)
    for w in (s1, s2, w1, w2):
        w.wait()
    assert got[0].tolist() == [1.0] * 5 and got[1].tolist() == [2.0] * 5
    assert pgs[0].stats["bytes_sent"] > 0 and pgs[0].stats["failed"] == 0


def test_async_collectives_overlap_and_complete_in_any_wait_order(groups_factory):
    pgs = groups_factory(2, "ltp")
    ts = [[torch.full((1000 * (k + 1),), float(r + k)) for k in range(8)] for r in range(2)]
    works = [[pg.allreduce([ts[r][k]]) for k in range(8)] for r, pg in enumerate(pgs)]
    for r in range(2):
        for w in reversed(works[r]):
            w.wait()
            assert w.is_completed() and w.is_success()
    for k in range(8):
        assert torch.equal(ts[0][k], torch.full((1000 * (k + 1),), float(2 * k + 1)))
        assert torch.equal(ts[0][k], ts[1][k])
    assert works[0][0].get_future().done()


def test_missing_rank_fails_with_named_cause_within_timeout(groups_factory):
    pgs = groups_factory(3, "ltp", "direct", timeout_s=2.0)
    t0 = time.monotonic()
    works = [pgs[r].allreduce([torch.ones(10)]) for r in (0, 1)]  # rank 2 never calls
    with pytest.raises(dist.DistBackendError) as ei:
        works[0].wait()
    took = time.monotonic() - t0
    assert took < 2.0 + 3.0, f"took {took:.1f} s with a 2 s timeout"
    msg = str(ei.value)
    assert "rank 0" in msg and "rank 2" in msg and "allreduce #0" in msg and "timeout" in msg
    with pytest.raises(B.LtpBackendError):
        works[1].wait()
    assert not works[1].is_success() and isinstance(works[1].exception(), B.LtpBackendError)


def test_shape_disagreement_is_an_error(groups_factory):
    pgs = groups_factory(2, "tcp", "direct", timeout_s=3.0)
    w0 = pgs[0].allreduce([torch.ones(10)])
    w1 = pgs[1].allreduce([torch.ones(12)])
    with pytest.raises(B.LtpBackendError, match="disagree|failed"):
        w0.wait()
    with pytest.raises(B.LtpBackendError):
        w1.wait()


def test_misuse_raises_config_errors(groups_factory):
    pgs = groups_factory(2, "tcp")
    with pytest.raises(ConfigError, match="AVG needs floating-point"):
        pgs[0].allreduce([torch.ones(3, dtype=torch.int64)], ar_opts(dist.ReduceOp.AVG))
    with pytest.raises(ConfigError, match="needs 2 output tensors"):
        pgs[0].allgather([[torch.empty(1)]], [torch.ones(1)])
    with pytest.raises(ConfigError, match="uneven all_gather"):  # each rank refuses before sending anything
        pgs[1].allgather([[torch.empty(1), torch.empty(2)]], [torch.ones(2)])
    with pytest.raises(ConfigError, match="match the input"):
        pgs[0].allgather([[torch.empty(2), torch.empty(2, dtype=torch.float64)]], [torch.ones(2)])
    with pytest.raises(ConfigError, match="any source"):
        pgs[0].recv_anysource([torch.empty(1)], 0)
    with pytest.raises(ConfigError, match="unknown"):
        B.BackendOptions(transport="quic").validate()
    with pytest.raises(ConfigError, match="algorithm"):
        B.BackendOptions(algorithm="tree").validate()
    pgs[1].shutdown()
    with pytest.raises(B.LtpBackendError, match="shut-down"):
        pgs[1].barrier()


@pytest.mark.parametrize("world", [2, 3])
def test_an_op_that_does_not_apply_to_the_dtype_fails_on_every_rank_at_once_and_the_group_goes_on(groups_factory,
                                                                                                   world):
    """Found by trying to break it: BAND on float tensors failed only on the rank that combined first (torch's
    NotImplementedError mid-collective), and the other ranks waited for it until the group timeout.  Now every
    rank refuses before sending anything, as gloo does, and the next collective is unaffected."""
    pgs = groups_factory(world, "ltp", timeout_s=10.0)
    bad = [(dist.ReduceOp.BAND, torch.float32, "integer or bool"), (dist.ReduceOp.BXOR, torch.float64, "integer"),
           (dist.ReduceOp.MIN, torch.complex64, "complex"), (dist.ReduceOp.AVG, torch.int32, "floating-point")]
    for op, dtype, why in bad:
        for pg in pgs:
            with pytest.raises(ConfigError, match=why):
                pg.allreduce([torch.ones(3, dtype=dtype)], ar_opts(op))
            o = dist.ReduceOptions()
            o.reduceOp, o.rootRank = op, 0
            with pytest.raises(ConfigError, match=why):
                pg.reduce([torch.ones(3, dtype=dtype)], o)
            rs = dist.ReduceScatterOptions()
            rs.reduceOp = op
            with pytest.raises(ConfigError, match=why):
                pg.reduce_scatter([torch.empty(2, dtype=dtype)], [[torch.ones(2, dtype=dtype)] * world], rs)
    ints = [torch.tensor([6, 3], dtype=torch.int64) + r for r in range(world)]
    run_all(pgs, lambda r, pg: pg.allreduce([ints[r]], ar_opts(dist.ReduceOp.BAND)))
    want = torch.tensor([6, 3], dtype=torch.int64)
    for r in range(1, world):
        want = want & (torch.tensor([6, 3], dtype=torch.int64) + r)
    assert all(torch.equal(t, want) for t in ints)
    xs = [torch.full((4,), float(r)) for r in range(world)]
    run_all(pgs, lambda r, pg: pg.allreduce([xs[r]]))
    assert all(torch.equal(x, torch.full((4,), float(sum(range(world))))) for x in xs)


def test_one_element_views_with_odd_strides_reduce_and_broadcast(groups_factory, transport):
    """Found by trying to break it: ``torch.tensor([a, b])[::2]`` has stride (2,) yet counts as contiguous, so
    the byte view of it failed on one rank while the other waited for the group timeout."""
    pgs = groups_factory(2, transport, timeout_s=10.0)
    xs = [torch.tensor([float(r + 1), 0.0])[::2] for r in range(2)]
    assert xs[0].stride() == (2,) and xs[0].is_contiguous()
    run_all(pgs, lambda r, pg: pg.allreduce([xs[r]]))
    assert [x.tolist() for x in xs] == [[3.0], [3.0]]
    ys = [torch.tensor([[float(r + 5)], [0.0]])[::2] for r in range(2)]  # shape (1, 1), strides (2, 1)
    o = dist.BroadcastOptions()
    o.rootRank = 1
    run_all(pgs, lambda r, pg: pg.broadcast([ys[r]], o))
    assert [y.tolist() for y in ys] == [[[6.0]], [[6.0]]]
    from ltp_ps.backend import _bytes

    with pytest.raises(RuntimeError, match="stride"):  # a tensor really strided is never re-strided into wrong bytes
        _bytes(torch.arange(6.0)[::2])
    zs = [torch.arange(4.0).reshape(2, 2)[:, 1:] * (r + 1) for r in range(2)]  # not contiguous: copied in and out
    run_all(pgs, lambda r, pg: pg.allreduce([zs[r]]))
    assert all(z.tolist() == [[3.0], [9.0]] for z in zs)


def test_init_process_group_single_rank_uses_the_store():
    store = dist.HashStore()
    dist.init_process_group("ltp", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=10))
    try:
        t = torch.arange(5.0)
        dist.all_reduce(t)
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        dist.barrier()
        pg = dist.group.WORLD
        assert isinstance(pg, B.LtpProcessGroup) and pg.getBackendName() == "ltp"
        assert dist.get_backend() == "ltp"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [3, 4])
def test_send_and_recv_between_two_ranks_leave_the_others_collectives_in_step(groups_factory, world):
    """Found by trying to break it: send/recv took a number from the group's collective counter on the two
    ranks involved only, so every later collective of a group of 3 or more paired the wrong messages and failed
    at the group timeout. Point-to-point operations now take no collective number."""
    pgs = groups_factory(world, "ltp", timeout_s=8.0)
    t0 = time.monotonic()
    for k in range(3):  # several, and in both directions
        got = torch.empty(3)
        s = pgs[0].send([torch.full((3,), float(k))], 1, 0)
        r = pgs[1].recv([got], 0, 0)
        s.wait()
        r.wait()
        assert got.tolist() == [float(k)] * 3
    back = torch.empty(2)
    run_all([pgs[1], pgs[0]], lambda i, pg: pg.send([torch.ones(2)], 0, 5) if i == 0 else pg.recv([back], 1, 5))
    assert back.tolist() == [1.0, 1.0]
    run_all(pgs, lambda r, pg: pg.barrier())
    xs = [torch.full((7,), float(r)) for r in range(world)]
    run_all(pgs, lambda r, pg: pg.allreduce([xs[r]]))
    assert all(torch.equal(x, torch.full((7,), float(sum(range(world))))) for x in xs)
    assert time.monotonic() - t0 < 8.0  # nothing waited for the group timeout
    assert pgs[0].stats["p2p"] == 4 and pgs[0].stats["collectives"] == 2 and pgs[2].stats["p2p"] == 0


@pytest.mark.parametrize("schedule", ["ring", "direct"])
def test_a_mismatch_seen_by_one_rank_fails_every_rank_at_once_and_the_group_goes_on(groups_factory, schedule):
    """Found by trying to break it: with ranks that disagree on sizes, the ranks that received a wrong-size message
    failed at once, but their ring neighbours waited for the whole group timeout (and failed their next collective
    too). The rank that sees the mismatch now tells the group (abort notices)."""
    world = 4
    pgs = groups_factory(world, "ltp", schedule=schedule, algorithm="ring" if schedule == "ring" else "direct",
                         timeout_s=20.0)
    cases = [("allgather", lambda r, pg: pg.allgather([[torch.empty(r + 1) for _ in range(world)]], [torch.ones(r + 1)])),
             ("allreduce", lambda r, pg: pg.allreduce([torch.ones(50_000 + r)]))]
    if schedule == "direct":  # under the ring schedule float32 and float64 take different tag spaces (docs/ddp.md)
        cases.append(("allreduce", lambda r, pg: pg.allreduce([torch.ones(1000, dtype=torch.float64 if r == 1
                                                                          else torch.float32)])))
    for name, call in cases:
        t0 = time.monotonic()
        works = [call(r, pg) for r, pg in enumerate(pgs)]
        errors = []
        for w in works:
            with pytest.raises(B.LtpBackendError) as ei:
                w.wait()
            errors.append(str(ei.value))
        assert time.monotonic() - t0 < 10.0, (name, errors)  # not the 20 s group timeout
        assert all(name in e for e in errors), errors
        assert any("disagree on tensor shapes or dtypes" in e or "does not fit" in e for e in errors), errors
        xs = [torch.full((5,), float(r)) for r in range(world)]
        run_all(pgs, lambda r, pg: pg.allreduce([xs[r]]))  # the group goes on
        assert all(torch.equal(x, torch.full((5,), 6.0)) for x in xs)
    assert sum(pg.stats["aborts_sent"] for pg in pgs) >= 1 and sum(pg.stats["aborts_received"] for pg in pgs) >= 1


def test_a_notice_between_numbering_and_start_is_kept_for_the_start(groups_factory):
    """Found by CI: a collective takes its number on the caller's thread and starts on the loop thread; a notice the
    loop handled in between was dropped as stale, and the rank waited for the whole group timeout."""
    pgs = groups_factory(2, "ltp", timeout_s=20.0)
    pg = pgs[1]
    hold, held = threading.Event(), threading.Event()

    def block():
        held.set()
        hold.wait(10)

    pg._io.loop.call_soon_threadsafe(block)
    assert held.wait(5)
    try:
        work = pg.allreduce([torch.ones(4)])  # numbered 0 here; its start waits behind the blocked loop
        assert pg._seq_floor() == 0
        pg._on_notice(0, 0, "rank 0 saw a mismatch")  # what the listener does with rank 0's notice
        pg._on_notice(1, 0, "a notice for a collective not issued yet is kept too")
        assert set(pg._aborted) == {0, 1}
    finally:
        hold.set()
    t0 = time.monotonic()
    with pytest.raises(B.LtpBackendError, match="rank 0 gave it up and told the group: rank 0 saw a mismatch"):
        work.wait()
    assert time.monotonic() - t0 < 5.0  # at its start, not at the 20 s timeout (rank 0 never joined)
    assert pg._seq_floor() == 1 and set(pg._aborted) == {1}
