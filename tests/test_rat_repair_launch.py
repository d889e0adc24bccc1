"""Real processes (``ltp-ps launch --schedule rat``): a worker that dies mid-run is cut out of the trees.

Worker 0 is the aggregator of the only tree (one PS shard, no topology: one rack, the root above it), so
before tree repair its death starved every other worker and failed the job.  Now the PS drops it, shard 0
writes a view on the store, and the other workers train on in trees without it.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from ps_helpers import child_env, launch_and_kill, ps_cmd

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


def _rows(metrics, event):
    return [r for r in map(json.loads, open(metrics)) if r.get("event") == event]


def _check(metrics, dead: int, n: int, min_accuracy: float = 0.9, out: str = ""):
    its = _rows(metrics, "iteration")
    drops = _rows(metrics, "dropped")
    assert [d["rank"] for d in drops] == [dead], drops
    after = [r for r in its if r["iteration"] >= drops[0]["iteration"] + 4]
    assert after and all(r["contributors"] == n - 1 for r in after), \
        f"contributors per round {[r['contributors'] for r in its]}; the launch printed:\n{out[-6000:]}"
    acc = [r["accuracy"] for r in _rows(metrics, "epoch") if r.get("accuracy") is not None]
    assert max(acc) >= min_accuracy, acc
    return its


@pytest.mark.parametrize("transport", ["tcp", "ltp"])
def test_worker_leaving_mid_run_is_cut_out_and_the_job_succeeds(tmp_path, transport):
    metrics = tmp_path / "m.jsonl"
    p = subprocess.run(ps_cmd("launch", "--schedule", "rat", "--workers", 4, "--epochs", 8, "--lab", "off",
                              "--transport", transport, "--metrics", metrics, "--model", "digits", "--seed", 0,
                              "--kill-worker-after", 12),
                       env=child_env(), capture_output=True, text=True, timeout=140)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "tree view 1: workers [0] are dead" in out, out[-4000:]
    assert "planning the trees without workers [0]" in out
    # nobody rejoins: a receive from the dead aggregator is hard evidence (TCP: its connection closed) or waits
    # for the board's word (LTP).  Before, over TCP every worker rejoined at once and restarted at round 0; a
    # second loss of the same kind exhausted --rejoin and hung the job (seen in CI)
    assert "rejoining" not in out, out[-4000:]
    _check(metrics, 0, 4, out=out)


def test_sigkilled_aggregator_is_cut_out_and_the_others_finish(tmp_path):
    metrics = tmp_path / "m.jsonl"
    text = launch_and_kill(("--schedule", "rat", "--workers", 5, "--epochs", 8, "--lab", "off", "--transport", "ltp",
                            "--model", "digits", "--seed", 1), tmp_path / "launch.out", metrics, rank=0,
                           after_rows=10, start_s=90, end_s=130)
    assert "final / best accuracy" in text, text[-4000:]  # the PS finished with the four others
    _check(metrics, 0, 5, out=text)


def test_two_shards_switch_trees_at_the_same_round_when_the_dead_worker_carried_tree_0(tmp_path):
    # worker 0 aggregates all of tree 0: once it is dead nobody waits for shard 0, and shard 1 and the workers ran
    # ahead of it; shard 1 planned the view's first round with the old trees, the shards dropped live workers
    # and the job failed (exit 3 in 3 of 6 seeds before the decided-through mark, tree_views)
    metrics = tmp_path / "m.jsonl"
    p = subprocess.run(ps_cmd("launch", "--schedule", "rat", "--workers", 6, "--num-servers", 2, "--epochs", 6,
                              "--lab", "off", "--transport", "tcp", "--metrics", metrics, "--model", "digits",
                              "--seed", 3, "--kill-worker-after", 15),
                       env=child_env(), capture_output=True, text=True, timeout=140)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    first = re.search(r"tree view 1: workers \[0\] are dead; the trees are rebuilt from round (\d+)", out)
    assert first, out[-4000:]
    switched = re.findall(r"\[(ps\d|w\d)\] round (\d+): planning the trees without workers \[0\]", out)
    assert sorted(n for n, _ in switched) == ["ps0", "ps1", "w1", "w2", "w3", "w4", "w5"], switched
    assert {int(r) for _, r in switched} == {int(first.group(1))}, switched
    _check(metrics, 0, 6, min_accuracy=0.8, out=out)
