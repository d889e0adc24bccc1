"""Test accuracy of a sharded model (``ltp_ps.sharded_eval``): shard 0 assembles every shard's slice."""

from __future__ import annotations

import datetime
import json
import subprocess
import threading
import time

import numpy as np
import pytest

from ltp_ps import cli, sharded_eval
from ltp_ps.sharding import ShardPlan
from ps_helpers import child_env, free_port, ps_cmd, workload

pytestmark = pytest.mark.timeout(120)

SECRET = b"job-secret"


def _client(port):
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10))


@pytest.fixture
def store():
    from torch.distributed import TCPStore

    port = free_port()
    master = TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    return master


def _slices(n=1000, k=3):
    plan = ShardPlan(n, k)
    full = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    return plan.ranges, full


def test_shard_zero_assembles_slices_published_later_by_other_shards(store):
    ranges, full = _slices()

    other = _client(store.port)  # another shard's process: its own store client

    def late():
        time.sleep(0.3)
        for s in (2, 1):
            lo, hi = ranges[s]
            sharded_eval.publish_slice(other, SECRET, s, 4, full[lo:hi])

    t = threading.Thread(target=late)
    t.start()
    got, why = sharded_eval.assemble(store, SECRET, ranges, full[:ranges[0][1]], 4, wait_s=5)
    t.join()
    assert why is None
    np.testing.assert_array_equal(got, full)
    assert not store.check(["eval/4/1"]) and not store.check(["eval/4/2"])  # cleaned up


def test_a_missing_slice_skips_the_epoch_naming_it(store):
    ranges, full = _slices()
    lo, hi = ranges[1]
    sharded_eval.publish_slice(store, SECRET, 1, 0, full[lo:hi])
    got, why = sharded_eval.assemble(store, SECRET, ranges, full[:ranges[0][1]], 0, wait_s=0.3)
    assert got is None and "eval/0/2" in why and "eval/0/1" not in why


def test_a_slice_under_another_secret_or_epoch_is_refused(store):
    ranges, full = _slices(k=2)
    lo, hi = ranges[1]
    sharded_eval.publish_slice(store, b"other-secret", 1, 0, full[lo:hi])
    got, why = sharded_eval.assemble(store, SECRET, ranges, full[:ranges[0][1]], 0, wait_s=1)
    assert got is None and "authentication" in why
    # a slice replayed under another epoch's key fails its MAC too (the epoch is under it)
    blob = store.get("eval/0/1") if store.check(["eval/0/1"]) else None
    assert blob is None  # assemble deleted it
    sharded_eval.publish_slice(store, SECRET, 1, 0, full[lo:hi])
    store.set("eval/1/1", store.get("eval/0/1"))
    got, why = sharded_eval.assemble(store, SECRET, ranges, full[:ranges[0][1]], 1, wait_s=1)
    assert got is None and "authentication" in why


def test_a_slice_of_the_wrong_size_is_refused(store):
    ranges, full = _slices(k=2)
    lo, hi = ranges[1]
    sharded_eval.publish_slice(store, SECRET, 1, 0, full[lo:hi - 1])
    got, why = sharded_eval.assemble(store, SECRET, ranges, full[:ranges[0][1]], 0, wait_s=1)
    assert got is None and "expected" in why


def test_only_judged_models_small_enough_are_eligible():
    wl = workload()
    assert sharded_eval.eligible(wl, wl.n_params)
    assert not sharded_eval.eligible(wl, sharded_eval.MAX_EVAL_BYTES // 4 + 1)

    class Synthetic:
        chance_accuracy = None

    assert not sharded_eval.eligible(Synthetic(), 10)


def test_summary_paths_of_shards_do_not_collide():
    assert cli.shard_path("/x/s.json", 0) == "/x/s.json"
    assert cli.shard_path("/x/s.json", 2) == "/x/s.shard2.json"
    assert cli.shard_path("/x/s", 1) == "/x/s.shard1.json"


@pytest.mark.parametrize("shards", [2, 3])
def test_a_sharded_launch_reports_and_judges_test_accuracy(tmp_path, shards):
    out = tmp_path / "summary.json"
    p = subprocess.run(ps_cmd("launch", "--lab", "off", "--transport", "ltp", "--workers", 2, "--num-servers", shards,
                              "--model", "digits", "--epochs", 3, "--summary-json", out),
                       env=child_env(), capture_output=True, text=True, timeout=110)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s0 = json.loads(out.read_text())
    assert s0["final_accuracy"] > 0.5, s0  # digits, 3 epochs, 2 workers: ~0.9 (chance 0.1)
    assert "[ps0] epoch   3/3  acc" in p.stdout
    for s in range(1, shards):
        assert (tmp_path / f"summary.shard{s}.json").exists()


def test_a_sharded_run_that_trains_nothing_fails(tmp_path):
    # lr 0: the model never moves, so it ends at chance; a sharded run is judged as a whole one is
    p = subprocess.run(ps_cmd("launch", "--lab", "off", "--transport", "tcp", "--workers", 2, "--num-servers", 2,
                              "--model", "digits", "--epochs", 3, "--lr", 0),
                       env=child_env(), capture_output=True, text=True, timeout=110)
    assert p.returncode == cli.EXIT_TRAINING_FAILED, p.stdout[-3000:] + p.stderr[-3000:]
