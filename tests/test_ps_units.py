"""Sans-IO units of ltp_ps: aggregation, critical ranges, wire, optimizer, sharding, feedback,
membership, staleness, checkpoints, schedules, metrics."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ltp_ps.aggregate import Aggregator, bubbles_to_elements, critical_ranges, limit_ranges, merge_ranges
from ltp_ps.checkpoint import checkpoint_path, load_latest, save_checkpoint
from ltp_ps.errors import ConfigError
from ltp_ps.feedback import ErrorFeedback
from ltp_ps.membership import Membership, Staleness, State
from ltp_ps.metrics import MetricsLog, epoch_loss, format_summary, read_jsonl, summarize
from ltp_ps.optim import FlatOptimizer
from ltp_ps.schedule import DirectSchedule, get_schedule
from ltp_ps.sharding import ShardPlan
from ltp_ps.wire import (BUBBLE_BYTES, HEADER_BYTES, KIND_PARAMS, GradHeader, ParamsHeader, decode_bubbles,
                         encode_bubbles, tag_of)

pytestmark = pytest.mark.timeout(60)


# -- aggregation ---------------------------------------------------------------
def _three_workers():
    g = [np.arange(8, dtype=np.float32) + 1, np.full(8, 10, np.float32), np.full(8, 100, np.float32)]
    lost = [[(2, 4)], [(3, 6)], []]  # element ranges each worker did not deliver
    return g, lost


def test_unbiased_mean_divides_by_deliverers():
    g, lost = _three_workers()
    agg = Aggregator(8, "unbiased")
    for x, l in zip(g, lost):
        agg.add(x, l)
    np.testing.assert_array_equal(agg.counts(), [3, 3, 2, 1, 2, 2, 3, 3])
    want = np.array([(1 + 10 + 100) / 3, (2 + 10 + 100) / 3, (10 + 100) / 2, 100 / 1, (5 + 100) / 2,
                     (6 + 100) / 2, (7 + 10 + 100) / 3, (8 + 10 + 100) / 3], np.float32)
    np.testing.assert_allclose(agg.result(), want, rtol=1e-6)


def test_zero_fill_mean_divides_by_all():
    g, lost = _three_workers()
    agg = Aggregator(8, "zero_fill")
    for x, l in zip(g, lost):
        agg.add(x, l)
    want = np.array([111, 112, 110, 100, 105, 106, 117, 118], np.float32) / 3
    np.testing.assert_allclose(agg.result(), want, rtol=1e-6)


def test_aggregator_ignores_garbage_inside_bubbles_and_zero_when_nobody_delivered():
    agg = Aggregator(4, "unbiased")
    agg.add(np.array([1, 7e30, 3, 4], np.float32), [(1, 2)])  # junk in a bubble must not leak
    agg.add(np.array([1, 9e30, 3, 4], np.float32), [(1, 2)])
    np.testing.assert_array_equal(agg.result(), [1, 0, 3, 4])
    agg.reset()
    assert agg.contributors == 0 and not agg.result().any()


_range = st.tuples(st.integers(-3, 40), st.integers(0, 3 * 17)).map(lambda t: (t[0], t[0] + t[1] // 3))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(_range, max_size=6), min_size=1, max_size=5), st.sampled_from(["unbiased", "zero_fill"]),
       st.integers(0, 2**31))
def test_property_overlapping_lost_ranges_count_each_element_once(workers_lost, mode, seed):
    # Bubbles that overlap each other, a critical range reported inside a bubble, ranges past the ends:
    # the counts must equal a per-element reference mask, and the mean must use exactly those counts.
    n = 37
    rng = np.random.default_rng(seed)
    agg = Aggregator(n, mode)
    delivered = np.zeros((len(workers_lost), n), dtype=bool)
    grads = rng.standard_normal((len(workers_lost), n)).astype(np.float32)
    for k, lost in enumerate(workers_lost):
        delivered[k] = True
        for a, b in lost:
            delivered[k, max(0, a):max(0, min(n, b))] = False
        g = grads[k].copy()
        assert agg.add(g, lost)
        np.testing.assert_array_equal(g, grads[k])  # the caller's gradient is read, never written
    want = delivered.sum(0)
    np.testing.assert_array_equal(agg.counts(), want)
    total = np.where(delivered, grads, 0).sum(0)
    ref = total / len(workers_lost) if mode == "zero_fill" else np.where(want > 0, total / np.maximum(want, 1), 0)
    np.testing.assert_allclose(agg.result(), ref, rtol=1e-5, atol=1e-6)
    m = agg.applied_mask()
    np.testing.assert_array_equal(np.ones(n, bool) if m is None else m, want > 0)
    nobody = np.zeros(n, bool)
    for a, b in agg.uncovered():
        assert 0 <= a < b <= n and not nobody[a:b].any()
        nobody[a:b] = True
    np.testing.assert_array_equal(nobody, want == 0)


def test_bubble_bookkeeping_stays_sparse_for_a_large_model():
    """The counts behind the unbiased mean are kept as ranges, not per element: a 100 M-element aggregate with
    thousands of bubbles needs no per-element count array (the dense one cost a VGG-16 PS seconds a round)."""
    n = 100_000_000
    agg = Aggregator(n)
    grad = np.ones(n, np.float32)
    lost = [(k * 10_000, k * 10_000 + 364) for k in range(5_000)]
    import tracemalloc

    tracemalloc.start()
    try:
        assert agg.add(grad, lost) and agg.add(grad, lost[::2]) and agg.add(grad)
        assert agg.applied_mask() is None and agg.uncovered() == []
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20_000_000, peak  # no copy of the gradient (400 MB), no per-element counts (800 MB)
    short = agg._short()
    assert len(short) == 5_000 and short[0] == (0, 364, 1) and short[1] == (10_000, 10_364, 2)
    out = agg.result()
    assert out[0] == 1.0 and out[364] == 1.0 and out[10_000] == 1.0 and float(out[:20_000].sum()) == 20_000.0


def test_aggregator_rejects_bad_mode_and_shape():
    with pytest.raises(ConfigError, match="unknown aggregation"):
        Aggregator(4, "median")
    with pytest.raises(ValueError, match="elements"):
        Aggregator(4).add(np.zeros(5, np.float32))


def test_bubbles_bytes_to_elements():
    # header of 64 bytes; bubble covering bytes 64+8 .. 64+20 -> elements 2..5; partial element counts as lost
    assert bubbles_to_elements([(72, 84)], offset=64, n_elems=10) == [(2, 5)]
    assert bubbles_to_elements([(70, 85)], offset=64, n_elems=10) == [(1, 6)]
    assert bubbles_to_elements([(0, 10)], offset=64, n_elems=10) == []  # header only
    assert bubbles_to_elements([(64, 10_000)], offset=64, n_elems=10) == [(0, 10)]
    assert merge_ranges([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]


def test_critical_ranges_cover_header_and_tensor_ends():
    layout = [(0, 10), (10, 5), (15, 100)]
    cr = critical_ranges(layout, header_bytes=64)
    assert cr == [(0, 68), (100, 108), (120, 128), (520, 524)]
    flat = set()
    for s, e in cr:
        flat.update(range(s, e))
    for off, n in layout:
        assert 64 + 4 * off in flat and 64 + 4 * (off + n) - 1 in flat
    assert all(b in flat for b in range(64))
    # shard 12..50: tensor 1 (10..15) is cut at 12, tensor 2 (15..115) at 50
    sh = critical_ranges(layout, header_bytes=64, shard=(12, 50))
    covered = set()
    for s, e in sh:
        covered.update(range(s, e))
    for model_elem in (12, 14, 15, 49):
        assert 64 + 4 * (model_elem - 12) in covered


def test_limit_ranges_closes_smallest_gaps_first():
    r = [(0, 10), (12, 14), (100, 104), (105, 106), (500, 504)]
    assert limit_ranges(r, None) == r
    assert limit_ranges(r, 4) == [(0, 10), (12, 14), (100, 106), (500, 504)]  # gap 1 closed
    assert limit_ranges(r, 3) == [(0, 14), (100, 106), (500, 504)]  # then gap 2
    assert limit_ranges(r, 1) == [(0, 504)]
    # a ResNet-50-sized layout (161 tensors) fits LTP's 160-range registration and keeps every end critical
    sizes = [64 * 3 * 49] + [256, 256] * 80
    layout, off = [], 0
    for n in sizes:
        layout.append((off, n))
        off += n
    cr = critical_ranges(layout, header_bytes=64, max_ranges=128)
    assert len(cr) <= 128
    for o, n in layout:
        for b in (64 + 4 * o, 64 + 4 * (o + n) - 1):
            assert any(s <= b < e for s, e in cr)


# -- wire ----------------------------------------------------------------------
def test_headers_roundtrip_and_reject_garbage():
    buf = np.zeros(HEADER_BYTES, np.uint8)
    h = GradHeader(rank=3, shard=1, iteration=77, model_version=76, samples=32, loss=0.5, compute_s=0.25)
    h.pack_into(buf)
    assert GradHeader.unpack(buf) == h
    assert GradHeader.unpack(np.zeros(HEADER_BYTES, np.uint8)) is None  # zero-filled header: nothing usable
    p = ParamsHeader(KIND_PARAMS, 0, 5, 5, 1000, 2, 1)
    p.pack_into(buf)
    assert ParamsHeader.unpack(buf) == p
    assert p.nbytes() == HEADER_BYTES + 4000 + 2 * BUBBLE_BYTES
    assert tag_of(3, 1) != tag_of(3, 2) != tag_of(4, 1)


def test_bubble_table_roundtrip_and_coarsening():
    per = {0: [(1, 3), (10, 12)], 5: [(0, 100)]}
    arr = encode_bubbles(per)
    assert decode_bubbles(arr.tobytes(), len(arr)) == per
    many = {1: [(i * 10, i * 10 + 1) for i in range(1000)]}
    small = encode_bubbles(many, max_entries=10)
    assert len(small) <= 10
    got = decode_bubbles(small.tobytes(), len(small))[1]
    covered = set()
    for s, e in got:
        covered.update(range(s, e))
    assert all(i * 10 in covered for i in range(1000))  # coarsening only over-reports


# -- optimizer -----------------------------------------------------------------
@pytest.mark.parametrize("kind,kw", [("sgd", dict(lr=0.1, momentum=0.9, weight_decay=1e-4)),
                                     ("adam", dict(lr=1e-2))])
def test_flat_optimizer_matches_plain_torch(kind, kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().copy()
    fo = FlatOptimizer(flat, kind, **kw)
    ref = (torch.optim.SGD(model.parameters(), **kw) if kind == "sgd" else torch.optim.Adam(model.parameters(), **kw))
    for step in range(5):
        x = torch.randn(8, 5)
        model.zero_grad()
        model(x).pow(2).sum().backward()
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().copy()
        ref.step()
        fo.step(g)
        want = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy()
        np.testing.assert_allclose(flat, want, rtol=1e-5, atol=1e-6)


def test_sharded_optimizers_equal_one_optimizer():
    rng = np.random.default_rng(1)
    full = rng.standard_normal(1000).astype(np.float32)
    plan = ShardPlan(1000, 3, align=64)
    parts = [full[lo:hi].copy() for lo, hi in plan.ranges]
    one = FlatOptimizer(full, "adam", lr=0.01)
    shards = [FlatOptimizer(p, "adam", lr=0.01) for p in parts]
    for _ in range(4):
        g = rng.standard_normal(1000).astype(np.float32)
        one.step(g)
        for o, (lo, hi) in zip(shards, plan.ranges):
            o.step(g[lo:hi])
    np.testing.assert_allclose(np.concatenate(parts), full, rtol=1e-6)


def test_optimizer_errors():
    with pytest.raises(ConfigError, match="unknown optimizer"):
        FlatOptimizer(np.zeros(3, np.float32), "lamb")
    with pytest.raises(ConfigError, match="float32"):
        FlatOptimizer(np.zeros(3, np.float64))


# -- sharding ------------------------------------------------------------------
@pytest.mark.parametrize("n,k", [(10, 1), (1000, 3), (25_557_032, 4), (7, 7)])
def test_shard_plan_is_contiguous_cover(n, k):
    plan = ShardPlan(n, k)
    r = plan.ranges
    assert r[0][0] == 0 and r[-1][1] == n and len(r) == k
    assert all(a[1] == b[0] for a, b in zip(r, r[1:]))
    assert all(hi > lo for lo, hi in r)
    sizes = [hi - lo for lo, hi in r]
    assert max(sizes) - min(sizes) <= max(plan.align, 1) + n // k // 100 + 1
    x = np.arange(n) if n < 10_000 else None
    if x is not None:
        np.testing.assert_array_equal(np.concatenate(plan.split(x)), x)
        assert plan.shard_of(n - 1) == k - 1


def test_shard_plan_errors():
    with pytest.raises(ConfigError):
        ShardPlan(3, 4)
    with pytest.raises(ConfigError):
        ShardPlan(3, 0)


# -- error feedback ------------------------------------------------------------
def test_error_feedback_carries_exactly_the_lost_part():
    ef = ErrorFeedback(6)
    g1 = np.arange(6, dtype=np.float32) + 1
    sent = ef.compensate(g1, iteration=0)
    np.testing.assert_array_equal(sent, g1)
    ef.lost(0, [(1, 3)])  # PS says elements 1,2 of round 0 were lost
    g2 = np.full(6, 10, np.float32)
    sent2 = ef.compensate(g2, iteration=1)
    np.testing.assert_array_equal(sent2, [10, 12, 13, 10, 10, 10])
    ef.lost(0, [(0, 6)])  # stale report about round 0: ignored
    ef.lost(1, [])
    np.testing.assert_array_equal(ef.compensate(np.zeros(6, np.float32), 2), np.zeros(6))
    # total mass is conserved: what was lost is delivered later
    assert ef.carried_elements == 2


# -- membership ----------------------------------------------------------------
def test_membership_drop_after_misses_and_rejoin():
    m = Membership(max_missed=2)
    m.admit(0, ("h", 1))
    m.admit(1, ("h", 2))
    assert [x.rank for x in m.active()] == [0, 1]
    assert not m.missed(1)
    m.delivered(1)  # resets the count
    assert not m.missed(1)
    assert m.missed(1)  # second miss in a row: dropped
    assert [x.rank for x in m.active()] == [0]
    assert m.members[1].state is State.DROPPED
    again = m.admit(1, ("h", 3), iteration=9)
    assert again.generation == 1 and again.addr == ("h", 3) and again.joined_iteration == 9
    m.failed(0, "broadcast failed")
    assert [x.rank for x in m.active()] == [1]
    kinds = [e.kind for e in m.drain_events()]
    assert kinds == ["joined", "joined", "dropped", "rejoined", "dropped"]
    assert m.drain_events() == []


def test_staleness():
    s = Staleness()
    assert s.record(5, 5) == 0
    assert s.record(3, 7) == 4
    assert s.record(9, 7) == 0
    assert s.max == 4 and s.mean == pytest.approx(4 / 3) and s.histogram == {0: 2, 4: 1}


# -- checkpoints ---------------------------------------------------------------
def test_checkpoint_roundtrip_and_mismatch(tmp_path):
    p = np.arange(10, dtype=np.float32)
    opt = FlatOptimizer(p.copy(), "sgd")
    opt.step(np.ones(10, np.float32))
    save_checkpoint(str(tmp_path), 0, params=p, optimizer_state=opt.state_dict(), iteration=7, version=7,
                    n_params=10, shard_range=(0, 10))
    st = load_latest(str(tmp_path), 0, n_params=10, shard_range=(0, 10))
    assert st["iteration"] == 7
    np.testing.assert_array_equal(st["params"].numpy(), p)
    FlatOptimizer(np.zeros(10, np.float32), "sgd").load_state_dict(st["optimizer"])
    assert load_latest(str(tmp_path), 1, n_params=10, shard_range=(0, 10)) is None
    with pytest.raises(ConfigError, match="another --checkpoint-dir"):
        load_latest(str(tmp_path), 0, n_params=11, shard_range=(0, 11))
    assert os.listdir(tmp_path) == ["ps-shard0.pt"]  # no temp files left


def test_checkpoint_crash_while_saving_keeps_previous(tmp_path, monkeypatch):
    p = np.ones(4, np.float32)
    save_checkpoint(str(tmp_path), 0, params=p, optimizer_state={}, iteration=1, version=1, n_params=4,
                    shard_range=(0, 4))

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(OSError):
        save_checkpoint(str(tmp_path), 0, params=p * 2, optimizer_state={}, iteration=2, version=2, n_params=4,
                        shard_range=(0, 4))
    monkeypatch.undo()
    st = load_latest(str(tmp_path), 0, n_params=4, shard_range=(0, 4))
    assert st["iteration"] == 1 and os.listdir(tmp_path) == [os.path.basename(checkpoint_path(str(tmp_path), 0))]


# -- schedules and metrics -----------------------------------------------------
def test_direct_schedule_plan():
    edges = DirectSchedule().plan([0, 1, 2], [0, 1])
    push = [e for e in edges if e.phase == "push"]
    pull = [e for e in edges if e.phase == "pull"]
    assert len(push) == 6 and not any(e.reliable for e in push)
    assert len(pull) == 6 and all(e.reliable for e in pull)
    assert {(e.src, e.dst) for e in pull} == {(f"server:{s}", f"worker:{w}") for s in (0, 1) for w in (0, 1, 2)}
    assert isinstance(get_schedule("direct"), DirectSchedule)
    with pytest.raises(ConfigError, match="available"):
        get_schedule("ring")


def test_metrics_jsonl_and_summary(tmp_path):
    path = str(tmp_path / "m.jsonl")
    log = MetricsLog(path)
    for i in range(4):
        log.write({"event": "iteration", "t": float(i), "gather_s": 0.01 * (i + 1), "broadcast_s": 0.001,
                   "delivered": {"0": 1.0, "1": 0.9}})
    log.write({"event": "epoch", "t": 4.0, "accuracy": 0.97})
    log.close()
    rows = read_jsonl(path)
    assert len(rows) == 5
    s = summarize(rows)
    assert s["iterations"] == 4 and s["final_accuracy"] == 0.97
    assert s["sync_mean_s"] == pytest.approx(0.026)
    assert s["delivered_min"] == 0.9 and s["delivered_mean"] == pytest.approx(0.95)
    text = format_summary(s)
    assert "26.00 ms" in text and "0.9700" in text


def test_rows_with_no_sync_round_are_not_averaged_in_as_zero(tmp_path):
    """MLfabric's dynamic updates have no gather/broadcast round: their rows say None, and the summary shows '-'
    rather than a 0.00 ms batch sync that nothing measured."""
    rows = [{"event": "iteration", "t": float(i), "gather_s": None, "broadcast_s": None, "delivered": {"all": 1.0}}
            for i in range(3)]
    s = summarize(rows)
    assert s["iterations"] == 3 and s["sync_mean_s"] != s["sync_mean_s"]  # NaN
    text = format_summary(s)
    assert "batch sync mean       - ms" in text and "0.00 ms" not in text
    rows.append({"event": "iteration", "t": 3.0, "gather_s": 0.004, "broadcast_s": 0.002, "delivered": {"0": 1.0}})
    assert summarize(rows)["sync_mean_s"] == pytest.approx(0.006)  # only the timed row counts


def test_rows_without_a_broadcast_timed_apart_count_their_round_and_no_made_up_broadcast():
    """A tree's round (rat) and an all-reduce step (ring, rsgcm) time the whole exchange as ``gather_s`` with no
    broadcast apart (``broadcast_s`` None): the batch sync is the round, and the summary's broadcast is '-', where
    it printed 'broadcast 0.00 ms' that nothing measured."""
    rows = [{"event": "iteration", "t": float(i), "gather_s": 0.01 * (i + 1), "broadcast_s": None,
             "delivered": {"all": 1.0}} for i in range(3)]
    s = summarize(rows)
    assert s["sync_mean_s"] == pytest.approx(0.02) and s["gather_mean_s"] == pytest.approx(0.02)
    assert s["broadcast_mean_s"] != s["broadcast_mean_s"]  # NaN
    text = format_summary(s)
    assert "batch sync mean       20.00 ms  (gather 20.00 ms, broadcast - ms)" in text, text
    rows.append({"event": "iteration", "t": 3.0, "gather_s": 0.004, "broadcast_s": 0.002, "delivered": {"0": 1.0}})
    s = summarize(rows)
    assert s["sync_mean_s"] == pytest.approx(0.0165) and s["broadcast_mean_s"] == pytest.approx(0.002)


def test_the_summary_title_says_mlfabric_applies_updates_asynchronously():
    from types import SimpleNamespace

    from ltp_ps.server import summary_text

    s = summarize([])

    def server(planner, mode="bsp"):
        return SimpleNamespace(shard=0, transport=SimpleNamespace(name="ltp"), planner=SimpleNamespace(name=planner),
                               cfg=SimpleNamespace(mode=mode, aggregation="unbiased"))

    assert "(ltp, mlfabric async, unbiased)" in summary_text(server("mlfabric"), s)
    assert "(ltp, bsp, unbiased)" in summary_text(server("direct"), s)
    assert "(ltp, async, unbiased)" in summary_text(server("direct", "async"), s)


def test_summary_json_is_standard_json_with_null_for_unmeasured_figures(tmp_path):
    """Found by trying to break it: MLfabric's untimed batch sync went into --summary-json as a bare NaN, which
    strict JSON parsers reject."""
    import json

    import numpy as np

    from ltp_ps.metrics import strict_json, write_summary_json

    path = tmp_path / "s.json"
    write_summary_json(str(path), {"sync_mean_s": float("nan"), "peak": float("inf"), "acc": np.float32(0.5),
                                   "rows": [1, np.int64(2), {"x": float("-inf")}], "name": "mlfabric", "ok": True})

    def refuse(c):
        raise ValueError(f"non-standard JSON constant {c}")
    got = json.loads(path.read_text(), parse_constant=refuse)
    assert got == {"sync_mean_s": None, "peak": None, "acc": 0.5, "rows": [1, 2, {"x": None}], "name": "mlfabric",
                   "ok": True}
    assert strict_json((1.5, None)) == [1.5, None]


def test_epoch_loss_means_the_rounds_that_report_one():
    rows = [{"loss": 0.5}, {"loss": float("nan")}, {"loss": 1.5}]
    assert epoch_loss(rows) == 1.0
    assert epoch_loss([{"loss": float("nan")}]) != epoch_loss([{"loss": float("nan")}])  # NaN: no round had one
    assert epoch_loss([]) != epoch_loss([])
    assert epoch_loss(rows, reports_loss=False) != epoch_loss(rows, reports_loss=False)  # a placeholder is no loss
