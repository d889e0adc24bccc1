"""ltp-lab schedules (tools/experiments/schedules.py): the pure pieces everywhere, a quick lab run where namespaces exist."""
from __future__ import annotations

import argparse
import csv
import json
import subprocess

import pytest

from ltp_ps.schedules import Topology
from ltp_ps.schedules.topology import HostLink, Uplink
from ltp_tools.experiments import schedules as S
from ltp_tools.netlab import check_support

_problem = check_support()
needs_lab = pytest.mark.skipif(_problem is not None, reason=f"network lab unavailable: {_problem}")


def _racks_topology(rate=100e6, uplink=100e6, failed=()):
    """The experiment's lab as a Topology: racks [3, 3], hosts listed in rank order (interleaved)."""
    hosts = [HostLink(f"h{i}", i // 3, rate, rate) for i in range(6)]
    hosts = tuple(hosts[i] for i in S.INTERLEAVE)
    ups = tuple(Uplink(r, uplink, uplink) for r in range(2))
    return Topology(hosts=hosts, uplinks=ups, failed=frozenset(frozenset(p) for p in failed))


def test_fluid_predictions_order_the_schedules_as_the_issue_expects():
    topo = _racks_topology()
    ring = S.predict("ring", topo, 6, 4_000_000)
    rs = S.predict("rsgcm", topo, 6, 4_000_000)
    direct = S.predict("direct", topo, 6, 4_000_000)
    assert 0 < rs <= 0.5 * ring          # the rack-aware ring crosses the uplinks twice, rank order six times
    assert rs <= 0.5 * direct            # the colocated PS's NIC carries 5 x 4 MB each way
    # a failed pair on the chosen ring: the replanned ring is predicted no slower than 1.3x
    failed = S.predict("rsgcm", _racks_topology(failed=[("h0", "h3")]), 6, 4_000_000)
    assert failed <= 1.3 * rs


def test_slower_uplinks_slow_the_rank_order_ring_more_than_rsgcm():
    fast, slow = _racks_topology(uplink=100e6), _racks_topology(uplink=25e6)
    d_ring = S.predict("ring", slow, 6, 1_000_000) / S.predict("ring", fast, 6, 1_000_000)
    d_rs = S.predict("rsgcm", slow, 6, 1_000_000) / S.predict("rsgcm", fast, 6, 1_000_000)
    assert d_ring > d_rs >= 1.0


def _row(i, t, attempts=1, rings=((0, 1, 2),)):
    return {"event": "iteration", "iteration": i, "t": t, "attempts": attempts, "plan": {"rings": [list(r) for r in rings]}}


def test_summary_of_a_blocked_run_counts_retries_and_lost_rounds():
    # rounds 1 s apart; the pair is blocked after row 4 (iteration 3); round 5 needs a retry (10 s), then 1.2 s
    ts = [0, 1, 2, 3, 4, 5, 16, 17.2, 18.4, 19.6]
    rows = [_row(i, t, attempts=2 if i == 6 else 1) for i, t in enumerate(ts)]
    job = {"rows": rows, "block_pair": [0, 1], "block_after_iteration": 3, "error": None}
    r = S._summarise_job("rsgcm+block", job, 10)
    assert r["replanned_after_attempts"] == 2 and r["retries"] == 1 and r["rounds_lost"] == 0
    assert r["before_s"] == pytest.approx(1.0) and r["after_s"] == pytest.approx(1.2)
    assert r["after_over_before"] == pytest.approx(1.2) and r["block_in_place_after"] == 3
    job["block_in_place_after"] = 4  # rank 0 finished a round while the rules went in
    assert S._summarise_job("rsgcm+block", job, 10)["block_in_place_after"] == 4
    job["rows"] = rows[:8]
    assert S._summarise_job("rsgcm+block", job, 10)["rounds_lost"] == 2


def test_checks_pass_and_fail_against_the_targets():
    summary = [{"schedule": "ring", "n": 1, "round_s_median": 2.0, "measured_over_predicted": 1.1},
               {"schedule": "rsgcm", "n": 1, "round_s_median": 1.5, "measured_over_predicted": 3.0},
               {"schedule": "direct", "n": 1, "round_s_median": 3.0, "measured_over_predicted": None},
               {"schedule": "rsgcm+block", "n": 1, "round_s_median": 1.5, "replanned_after_attempts": 2,
                "after_over_before": 1.4, "rounds_lost_max": 0, "measured_over_predicted": None}]
    got = {c["target"]: c["passed"] for c in S.check(summary, [])}
    assert got["rsgcm / ring all-reduce time"] is False        # 0.75 > 0.5
    assert got["rsgcm all-reduce / direct BST"] is True         # 0.5
    assert got["attempts until a complete round after the block"] is True
    assert got["time after / before the block"] is False
    assert got["rounds lost (max over repeats)"] is True
    assert got["ring: measured / fluid prediction"] is True
    assert got["rsgcm: measured / fluid prediction"] is False


def test_cli_is_registered_and_rejects_unknown_rows():
    p = argparse.ArgumentParser()
    S.register(p.add_subparsers())
    a = p.parse_args(["schedules", "--quick", "--schedules", "ring,rsgcm"])
    assert a.func is S._cli and a.quick
    with pytest.raises(ValueError, match="unknown schedule row"):
        S.run(schedules=("bogus",), quick=True)
    from ltp_tools import cli
    with pytest.raises(SystemExit) as e:
        cli.main(["schedules", "--help"])
    assert e.value.code == 0


@needs_lab
@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_lab_run_replans_around_a_blocked_pair(tmp_path):
    """A small model, one repeat: rsgcm with a pair blocked mid-run completes every round; files are written."""
    out = tmp_path / "sch"
    res = S.run(schedules=("rsgcm+block",), model_bytes=200_000, rounds=6, block_at=3, quick=True, out=str(out),
                progress=False, verbose=False, fluid=False)
    (run,) = res["runs"]
    assert run["error"] is None, run["error"]
    assert run["block_pair"] and run["rounds_lost"] == 0
    a, b = (int(x) for x in run["block_pair"].split("-"))
    # rank 0 may finish rounds while the block's rules go in: the round after the last of them may have crossed
    # the pair before the rules took effect; every later round started behind the block
    behind = [m for m in run["metrics"] if m["iteration"] > run["block_in_place_after"] + 1]
    assert run["block_in_place_after"] + 1 >= run["block_at"] and behind
    used = any(abs(ring.index(a) - ring.index(b)) in (1, len(ring) - 1)
               for m in behind for ring in m["plan"]["rings"] if a in ring and b in ring)
    if run["replanned_after_attempts"] is None:  # the block hit no plan: no round needed a retry or used the pair
        assert all(m["attempts"] == 1 for m in run["metrics"]) and not used
    else:  # it hit: a complete round within the target, and no later ring uses the blocked edge
        assert run["replanned_after_attempts"] <= S.TARGET_REPLAN_ROUNDS
        hit = next(m for m in run["metrics"] if m["attempts"] > 1)
        assert not any(abs(ring.index(a) - ring.index(b)) in (1, len(ring) - 1)
                       for m in run["metrics"] if m["iteration"] >= hit["iteration"]
                       for ring in m["plan"]["rings"] if a in ring and b in ring)
    assert run["predicted_s"] > 0 and run["round_s_median"] > 0
    with open(out / "checks.csv", newline="") as f:
        assert any(r["target"].startswith("rounds lost") and r["passed"] == "True" for r in csv.DictReader(f))
    assert json.loads((out / "results.json").read_text())["command"].startswith("ltp-lab schedules")
    assert (out / "schedules.png").read_bytes()[:4] == b"\x89PNG"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not any(p + "-" in listed for p in res["lab_prefixes"])  # the lab cleaned up its namespaces


def test_fluid_only_rows_name_the_unmeasured_targets():
    rows = S.fluid_only_rows()
    assert len(rows) == 5 and all(r["predicted"] > 0 for r in rows)
    assert any(r["row"].startswith("RAT / direct") for r in rows)


def test_rat_and_hoplite_rows_are_predicted_and_checked():
    """Issue 11's lab rows: RAT and Hoplite run as PS jobs in the same lab; predictions exist and the
    checks compare them with direct and ring (pass and fail both reachable)."""
    topo = _racks_topology(uplink=50e6)
    for s in ("rat", "hoplite"):
        assert s in S.SCHEDULES and s in S.PS_SCHEDULES
        assert S.predict(s, topo, 6, 4_000_000) > 0
    summary = [{"schedule": "direct", "round_s_median": 4.0}, {"schedule": "ring", "round_s_median": 2.0},
               {"schedule": "rat", "round_s_median": 1.5}, {"schedule": "hoplite", "round_s_median": 2.0}]
    got = {c["target"]: c["passed"] for c in S.check(summary, [])}
    assert got["rat round / direct BST (issue 11)"] is True
    assert got["rat round / ring all-reduce (issue 11)"] is True
    assert got["hoplite round / direct BST (issue 11)"] is False  # 0.5 > 0.4


def test_colocated_and_paused_rows_are_predicted_as_the_fluid_model_says():
    """Issue 11's RAT rows with K = 6 colocated shards and one worker paused (1 Mbit/s, redrawn every 2 s)."""
    topo = _racks_topology(uplink=50e6)
    p = {s: S.predict(s, topo, 6, 4_000_000) for s in ("ring", "rat6", "rat6c4", "direct6", "ring+pause",
                                                          "rat6+pause")}
    assert p["rat6"] < 0.6 * p["direct6"]  # 0.56: what the docs state for the issue's setup
    assert p["rat6c4"] < 0.5 * p["direct6"]  # cut-through pieces: 0.47
    assert p["rat6+pause"] > p["rat6"] and p["ring+pause"] > p["ring"]
    assert 1.0 < p["ring+pause"] / p["rat6+pause"] < S.TARGET_RING_OVER_RAT_PAUSED  # the model predicts a miss


def test_the_rotation_is_seeded_one_worker_at_a_time_and_throttles_colocated_nodes():
    topo = _racks_topology()
    a, b = S.rotating_pauses(topo, 6, 7), S.rotating_pauses(topo, 6, 7)
    seq = [a.paused(t) for t in (0.0, 2.0, 4.1, 9.9)]
    assert seq == [b.paused(t) for t in (0.0, 2.0, 4.1, 9.9)]  # the lab and the prediction draw the same hosts
    assert all(len(x) == 1 and next(iter(x)) in topo.names for x in seq)
    assert a.next_change(0.5) == pytest.approx(S.PAUSE_PERIOD_S) and a.rate_bps == S.PAUSE_BPS
    _, world = S._world_of_row("rat6+pause", topo, 6, 1_000_000)
    hp = S._HostPauses(a, world)
    (host,) = a.paused(0.0)
    r = topo.names.index(host)
    assert hp.paused(0.0) == {f"worker:{r}", f"server:{r}"}  # shard r lives on worker r's host


def test_colocated_and_paused_checks_pass_and_fail():
    summary = [{"schedule": "direct6", "round_s_median": 2.0}, {"schedule": "rat6", "round_s_median": 1.2},
               {"schedule": "rat6c4", "round_s_median": 0.9}, {"schedule": "ring", "round_s_median": 3.0},
               {"schedule": "ring+pause", "round_s_median": 6.0}, {"schedule": "rat6+pause", "round_s_median": 4.0}]
    got = {c["target"]: (c["value"], c["passed"]) for c in S.check(summary, [])}
    assert got["rat round / direct BST, K = 6 colocated shards (issue 11)"] == (pytest.approx(0.6), False)
    assert got["rat round, cut-through (4 pieces), / direct BST, K = 6 colocated (issue 11)"][1] is True
    assert got["rat round (K = 6 colocated) / ring all-reduce (issue 11)"][1] is True
    assert got["ring / rat (K = 6) with one worker paused (issue 11)"] == (pytest.approx(1.5), False)


@needs_lab
@pytest.mark.netns
@pytest.mark.timeout(300)
def test_a_paused_colocated_rat_job_completes_under_the_rotating_throttle(tmp_path):
    """13 processes (store, 6 shards, 6 workers) with one worker's egress at 1 Mbit/s at a time: every round
    completes (a parameter hop through the throttled host may time out: the workers behind it compute on the
    slice they hold, tests/test_tree_stale_params.py) and the throttle is set and lifted."""
    res = S.run(schedules=("rat6+pause",), model_bytes=200_000, rounds=4, quick=True, out=str(tmp_path / "p"),
                progress=False, verbose=False, fluid=False)
    (run,) = res["runs"]
    assert run["error"] is None, run["error"]
    assert run["completed"] == 4 and run["pauses"] >= 1
    assert all(len(hosts) == 1 for _, hosts in run["pause_log"])
