"""Real processes (``ltp-ps launch --lab off --transport ltp``): a process paused with SIGSTOP, then resumed.

A pause is not a death: no socket closes, nothing answers.  Found by trying it:
* the PS of a ``hoplite`` or ``mlfabric`` job paused for 15 s ended the job (every worker left at LTP's 5 s
  dead-peer limit to rejoin, which those PS loops never serve; the resumed PS wrote every worker off as silent);
* a ``direct`` worker paused for 8 s was dropped and then waited out its 60 s ``--pull-timeout``, outliving the
  job (the launch failed it for not exiting).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from ps_helpers import child_env, ps_cmd, stop, wait_for_rows

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]


def _pause_during(args, out, metrics, *, who: str, after_rows: int, pause_s: float, end_s: float = 150):
    with open(out, "w") as f:
        proc = subprocess.Popen(ps_cmd("launch", *args, "--metrics", metrics), env=child_env(), stdout=f,
                                stderr=subprocess.STDOUT, text=True)
        try:
            pid = wait_for_rows(proc, out, metrics, after_rows=after_rows, within_s=60, who=who)
            os.kill(pid, signal.SIGSTOP)
            time.sleep(pause_s)
            os.kill(pid, signal.SIGCONT)
            rc = proc.wait(end_s)
        finally:
            stop(proc)
    return rc, open(out).read()


def _epochs(metrics):
    return [r for r in map(json.loads, open(metrics)) if r.get("event") == "epoch"]


@pytest.mark.parametrize("schedule", ["hoplite", "mlfabric"])
def test_a_ps_paused_past_the_dead_peer_limit_does_not_end_a_controller_job(tmp_path, schedule):
    metrics = tmp_path / "m.jsonl"
    rc, text = _pause_during(["--schedule", schedule, "--workers", 3, "--epochs", 6, "--lab", "off", "--transport",
                              "ltp", "--model", "digits", "--seed", 0], tmp_path / "out.txt", metrics,
                             who="ps0", after_rows=5, pause_s=10.0)
    assert rc == 0, text
    assert "rejoining" not in text and "silent for" not in text, text
    assert len(_epochs(metrics)) == 6, text


def test_a_direct_worker_paused_and_dropped_rejoins_at_once(tmp_path):
    metrics = tmp_path / "m.jsonl"
    # The PS drops worker 1 5.5-7.5 s in and it rejoins at about 12.5 s.  --compute-delay caps the rounds the
    # two others run meanwhile at 100 a second, so 60 epochs (900 rounds) leave hundreds after the rejoin on any
    # machine; 150 epochs without the cap took 57 s here and up to 153 s on a slow CI machine.
    rc, text = _pause_during(["--workers", 3, "--epochs", 60, "--compute-delay", 0.01, "--lab", "off", "--transport",
                              "ltp", "--model", "digits", "--seed", 0], tmp_path / "out.txt", metrics,
                             who="worker 1", after_rows=20, pause_s=12.0)
    assert rc == 0, text
    assert "dropped by PS shard 0" in text, text
    rows = [r for r in map(json.loads, open(metrics))]
    drop = next(i for i, r in enumerate(rows) if r.get("event") == "dropped")
    back = [i for i, r in enumerate(rows) if r.get("event") in ("rejoined", "join") and i > drop]
    assert back, [r for r in rows if r.get("event") not in ("iteration", "epoch")]
    late = [r for r in rows[back[0]:] if r.get("event") == "iteration"]
    assert late and max(r["contributors"] for r in late) == 3, late[-3:]


def _paused_worker_returns(tmp_path, schedule: str, *, epochs: int, after_rows: int, pause_s: float = 12.0,
                           extra=()) -> list:
    """Pause worker 1 of a 3-worker ``schedule`` job for ``pause_s``; the launch must succeed with the worker
    dropped and taken in again.  Returns the metrics rows from its return on."""
    metrics = tmp_path / "m.jsonl"
    rc, text = _pause_during(["--schedule", schedule, "--workers", 3, "--epochs", epochs, "--lab", "off",
                              "--transport", "ltp", "--model", "digits", "--seed", 0, *extra], tmp_path / "out.txt",
                             metrics, who="worker 1", after_rows=after_rows, pause_s=pause_s)
    assert rc == 0, text
    assert "dropped worker 1" in text and "worker 1 joined again" in text, text
    rows = [r for r in map(json.loads, open(metrics))]
    back = [i for i, r in enumerate(rows) if r.get("event") == "rejoined"]
    assert back, [r for r in rows if r.get("event") not in ("iteration", "epoch")]
    return [r for r in rows[back[-1]:] if r.get("event") == "iteration"]


def test_a_hoplite_worker_paused_and_dropped_is_taken_in_again(tmp_path):
    """The Hoplite PS writes a worker silent for 10 s off; resumed, it joins again and the PS takes it in at the
    next round (fresh control streams whose epoch is the join's ticket; the others are told it is back)."""
    late = _paused_worker_returns(tmp_path, "hoplite", epochs=40, after_rows=10)
    assert late and late[-1]["contributors"] == 3 and "worker:1" in late[-1]["members"], late[-3:]


def test_a_hoplite_async_worker_paused_and_dropped_is_taken_back_and_contributes_again(tmp_path):
    """``--mode async``: the PS writes the paused worker off at 10 s; resumed, it joins again and the PS takes it
    back between updates (it gets the next version with that update's members).  Before, the asynchronous PS never
    looked at the store again: the worker waited out the job with its join pending and the job ran one short."""
    # --compute-delay sets a floor under the job's length whatever the machine's speed (at most 25 gradients per
    # second per worker, 450 each: 18 s, about 5 s left after the 12 s pause ends, and the machine's own compute
    # comes on top); with 40 epochs and no delay a fast run ended 1 s after the PS wrote the worker off, before it
    # could come back.  (60 epochs at 0.02 s had the same floor and twice the compute: 100 s on a slow CI machine.)
    late = _paused_worker_returns(tmp_path, "hoplite", epochs=30, after_rows=10,
                                  extra=("--mode", "async", "--momentum", "0", "--lr", "0.4", "--compute-delay", "0.04"))
    assert late and late[-1]["workers"] == 3, late[-3:]
    assert sum("worker:1" in r["members"] for r in late) >= len(late) // 3, late[-5:]
    assert all(max(r["staleness"].values()) <= 2 for r in late)


def test_a_hoplite_worker_paused_right_after_joining_costs_the_job_only_itself(tmp_path):
    """Worker 2 stopped the moment the PS has logged the four joins (``after_rows=4``: join rows carry an
    iteration field), 15 s.  Before: a worker published its address for its peers only after its join, and
    every worker waited for every peer's address before its first heartbeat -- so one stopped between the two
    held all of them, and the PS wrote off all four as silent at 10 s (rc 3, most runs).  Now the address goes
    out before the join and controller schedules never wait for peers: the job loses worker 2 only."""
    metrics = tmp_path / "m.jsonl"
    rc, text = _pause_during(["--schedule", "hoplite", "--workers", 4, "--iterations", 30, "--lab", "off",
                              "--transport", "ltp", "--model", "digits", "--seed", 0], tmp_path / "out.txt",
                             metrics, who="worker 2", after_rows=4, pause_s=15.0, end_s=120)
    assert rc == 0, text
    for r in (0, 1, 3):
        assert f"dropped worker {r}" not in text, text
    its = [r for r in map(json.loads, open(metrics)) if r.get("event") == "iteration"]
    assert len(its) == 30 and min(r["contributors"] for r in its) >= 3, its[:3]


def test_an_mlfabric_worker_paused_and_dropped_is_taken_in_again(tmp_path):
    """The MLfabric PS writes off a worker it cannot reach (a grant or parameters to it fail at LTP's dead-peer
    limit) or that is silent for --store-timeout (paused while computing, nobody needs it: an asynchronous PS
    waits for no one, so 20 s of silence is the only sign) and posts the drop; resumed after 25 s, the worker sees
    it in the store, joins again at once, and the PS takes it in (fresh control and parameter streams, the
    controller plans its updates again).  Before: the PS never took it back, and the driver's write-off was not
    posted, so the worker waited out its 60 s --pull-timeout."""
    later = _paused_worker_returns(tmp_path, "mlfabric", epochs=120, after_rows=30, pause_s=25.0,
                                   extra=("--store-timeout", 20))
    assert any("worker:1" in r["members"] for r in later), later[-5:]


def _pause_rat_worker_until_view_1(tmp_path, metrics, transport: str, *extra):
    """A 4-worker, 40-epoch ``rat`` launch with worker 1 SIGSTOPped after 20 metric rows and resumed as soon as the
    PS logs tree view 1 (while the job still runs); returns (exit status, output)."""
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        proc = subprocess.Popen(ps_cmd("launch", "--schedule", "rat", "--workers", 4, "--epochs", 40, "--lab", "off",
                                       "--transport", transport, "--model", "digits", "--seed", 0, *extra,
                                       "--metrics", metrics),
                                env=child_env(), stdout=f, stderr=subprocess.STDOUT, text=True)
        try:
            pid = wait_for_rows(proc, out, metrics, after_rows=20, within_s=60, who="worker 1")
            os.kill(pid, signal.SIGSTOP)
            deadline = time.monotonic() + 90
            while "tree view 1:" not in open(out).read() and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.1)
            os.kill(pid, signal.SIGCONT)
            rc = proc.wait(150)
        finally:
            stop(proc)
    return rc, open(out).read()


@pytest.mark.parametrize("transport", ["tcp", "ltp"])
def test_a_rat_worker_declared_dead_while_paused_comes_back_into_the_trees(tmp_path, transport):
    """A RAT worker paused (SIGSTOP) past --max-missed rounds is written out of the trees; resumed, it asks to come
    back and the trees take it in again (``tree_views``, "Coming back").  Found by trying it over TCP, two bugs
    before that:
    * its tree parent never suspected it: the kernel buffered the parameter sends to the paused worker, and a
      completed send counted as an exchange with a live peer, so every round waited out its timeout and the job
      crawled on with 3 of 4 workers (LTP's sends need the peer's own ACKs, so there it was suspected);
    * a worker declared dead while alive exited 3 (``Excluded``) on waking, failing the launch although the PS
      trained on and finished.
    Until this stop such a worker stayed out for the rest of the job.  The worker is resumed as soon as the view
    is out, while the job still runs."""
    metrics = tmp_path / "m.jsonl"
    rc, text = _pause_rat_worker_until_view_1(tmp_path, metrics, transport)
    if transport == "tcp":
        assert "[w0] suspects worker 1 is dead" in text, text[-4000:]
    assert "tree view 1: workers [1] are dead" in text, text[-4000:]
    assert rc == 0, text[-4000:]
    assert "worker 1 is taken back into the trees (generation 1)" in text, text[-4000:]
    assert "[w1] round" in text and "back in the trees (generation 1)" in text, text[-4000:]
    rows = [r for r in map(json.loads, open(metrics))]
    back = next(i for i, r in enumerate(rows) if r.get("event") == "rejoined" and r.get("rank") == 1)
    late = [r for r in rows[back:] if r.get("event") == "iteration"]
    assert late and late[-1]["contributors"] == 4, [(r["iteration"], r["contributors"]) for r in late[-5:]]
    assert len(_epochs(metrics)) == 40, text[-4000:]


def test_a_rat_worker_that_may_not_come_back_waits_for_the_job_and_exits_with_its_verdict(tmp_path):
    """``--max-returns 0``: a worker declared dead while alive stays out (``Excluded``).  It waits for the job's end
    and exits with the job's verdict (before, it exited 3 at once and failed a launch whose PS trained on)."""
    metrics = tmp_path / "m.jsonl"
    rc, text = _pause_rat_worker_until_view_1(tmp_path, metrics, "tcp", "--max-returns", 0)
    assert "tree view 1: workers [1] are dead" in text, text[-4000:]
    assert rc == 0, text[-4000:]
    assert "--max-returns 0" in text and "taken back" not in text, text[-4000:]
    assert "[worker 1] the job finished without this worker (excluded)" in text, text[-4000:]
    assert len(_epochs(metrics)) == 40, text[-4000:]


def test_a_hoplite_relay_aborted_by_a_pause_leaves_the_relay_lane_running(tmp_path):
    """A 2 M-parameter model, so parameters travel in 31 chunks relayed by partial copies.  Worker 2 is paused
    after three rounds (``after_rows`` counts the four join rows too) while others relay to it; the PS's
    `failed` note (or the next round's note) aborts those relays.  Before, that abort ended the worker's relay
    lane for good (a cancelled gather ends with a CancelledError exception, which the lane took for its own
    cancellation): its later forward grants waited in the queue and every round from then on took the 60 s
    receive timeout of the worker downstream.  Now the lane goes on, and the rounds after the paused worker's
    return are as fast as before it."""
    metrics = tmp_path / "m.jsonl"
    rc, text = _pause_during(["--schedule", "hoplite", "--workers", 4, "--iterations", 16, "--lab", "off",
                              "--transport", "ltp", "--model", "synthetic:2000000", "--seed", 0],
                             tmp_path / "out.txt", metrics, who="worker 2", after_rows=7, pause_s=15.0, end_s=120)
    assert rc == 0, text
    assert "dropped worker 2" in text, text
    rows = [r for r in map(json.loads, open(metrics)) if r.get("event") == "iteration"]
    assert len(rows) == 16, text
    slow = [(r["iteration"], round(r["round_s"], 1)) for r in rows if r["round_s"] > 12.0]
    assert len(slow) <= 1, slow  # at most the round that waited for the paused worker to be written off
