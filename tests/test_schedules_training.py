"""ltp-lab schedules --experiment mlfabric|accuracy (tools/experiments/schedules_training.py): the pure pieces
everywhere, short lab runs where namespaces exist."""
from __future__ import annotations

import random

import pytest

from ltp_ps import cli
from ltp_tools.experiments import schedules as S
from ltp_tools.experiments import schedules_training as T
from ltp_tools.netlab import check_support

_problem = check_support()
needs_lab = pytest.mark.skipif(_problem is not None, reason=f"network lab unavailable: {_problem}")


def _job(row="mlfabric", iters=(), epochs=()):
    return T.Job(row, "ltp", {}, [*({"event": "iteration", **i} for i in iters),
                                  *({"event": "epoch", **e} for e in epochs)], {}, None, 1.0)


def test_n3_profile_scaled_draws_10_or_100_mbit_half_and_half():
    rng = random.Random(5)
    draws = [T.n3_draw(rng) for _ in range(4000)]
    assert set(draws) == {10e6, 100e6}
    assert 0.45 < draws.count(10e6) / len(draws) < 0.55


def test_time_to_counts_from_the_first_applied_update_and_reads_epoch_ends():
    j = _job(iters=[{"t": 100.0, "staleness": 0}, {"t": 101.0, "staleness": 2}],
             epochs=[{"t": 103.0, "accuracy": 0.5}, {"t": 110.0, "accuracy": 0.96}, {"t": 111.0, "accuracy": 0.9}])
    assert T.time_to(j, 0.5) == pytest.approx(3.0)
    assert T.time_to(j, 0.95) == pytest.approx(10.0)
    assert T.time_to(j, 0.97) is None
    assert (T.best(j), T.final(j)) == (0.96, 0.9)
    assert T.time_to(_job(), 0.1) is None


def test_staleness_counts_every_member_of_an_aggregate():
    j = _job(iters=[{"t": 0, "staleness": 3, "staleness_all": [3, 1, 0]}, {"t": 1, "staleness": 5}])
    assert T.staleness_of(j) == [3, 1, 0, 5]
    sp = T.spread([3, 1, 0, 5])
    assert sp["staleness_max"] == 5 and sp["staleness_std"] == pytest.approx(1.920286, rel=1e-5)
    assert T.spread([])["staleness_std"] is None


def _jobs(best):
    return {r: _job(r, iters=[{"t": 0.0, "staleness": 9}],
                    epochs=[{"t": 5.0, "accuracy": b / 2}, {"t": 10.0, "accuracy": b}]) for r, b in best.items()}


def test_target_is_95_when_everybody_reached_it_else_the_best_common_accuracy():
    rows = T._tta_rows(_jobs({"mlfabric": 0.97, "ring": 0.96, "direct-async": 0.95}), 0, 8, "ltp")
    assert {r["target_kind"] for r in rows} == {"0.95"} and all(r["time_to_target_s"] == 10.0 for r in rows)
    rows = T._tta_rows(_jobs({"mlfabric": 0.97, "ring": 0.80, "direct-async": 0.90}), 0, 8, "ltp")
    assert {(r["target_kind"], r["target"]) for r in rows} == {("best common", 0.80)}
    by = {r["row"]: r for r in rows}
    assert by["ring"]["time_to_target_s"] == 10.0 and by["mlfabric"]["time_to_target_s"] == 10.0
    assert by["mlfabric"]["beyond_tau"] == 1 and by["ring"]["beyond_tau"] is None  # staleness 9 > tau_max 8


def test_checks_compare_mlfabric_with_both_baselines_and_count_beyond_tau():
    summary = [{"row": "mlfabric", "time_to_target_s": 6.0, "staleness_std": 1.0, "beyond_tau": 0},
               {"row": "ring", "time_to_target_s": 10.0}, {"row": "direct-async", "time_to_target_s": 7.0,
                                                           "staleness_std": 3.0}]
    c = {x["target"]: x for x in T._tta_checks(summary)}
    assert c["mlfabric / ring time to target accuracy"]["passed"]  # 0.6 <= 0.75
    assert not c["mlfabric / direct-async time to target accuracy"]["passed"]  # 0.857 > 0.8
    assert c["mlfabric updates applied beyond tau_max"]["passed"]
    assert c["mlfabric / async direct staleness std"]["value"] == pytest.approx(1 / 3)


def test_every_row_is_a_valid_ltp_ps_command_line():
    for row, extra in T.TRAIN_ARGS.items():
        a = cli.build_parser().parse_args(["server", *extra])
        assert a.schedule == T.base_schedule(row)
    assert T.runs_without_ps("ring") and T.runs_without_ps("rsgcm") and not T.runs_without_ps("direct-async")
    assert T.unavailable("direct") is None and T.unavailable("mlfabric") is None
    why = T.unavailable("hoplite")  # not wired into ltp-ps server when this was written; the reason is kept
    assert why is None or "hoplite" in why


def test_cli_dispatches_the_experiments():
    import argparse

    p = argparse.ArgumentParser()
    S.register(p.add_subparsers())
    a = p.parse_args(["schedules", "--experiment", "accuracy", "--losses", "0,0.02", "--transports", "tcp"])
    assert (a.experiment, a.losses, a.transports) == ("accuracy", "0,0.02", "tcp")
    with pytest.raises(ValueError, match="unknown row"):
        T.run_tta(rows=("bogus",))
    with pytest.raises(ValueError, match="unknown row"):
        T.run_accuracy(rows=("bogus",))


@needs_lab
@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lab_accuracy_row_reference_job(tmp_path):
    """One epoch of direct over TCP without loss in the lab: it trains, and is its own reference (gap 0)."""
    res = T.run_accuracy(rows=("direct",), transports=("tcp",), losses=(0.0,), epochs=1, out=str(tmp_path),
                         progress=False, verbose=False)
    (run,) = res["runs"]
    assert run["error"] is None, run["error"]
    assert run["epochs_done"] == 1 and run["final_accuracy"] > 0.15 and run["gap_points"] == 0.0
    assert (tmp_path / "accuracy" / "runs.csv").exists()


@needs_lab
@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_lab_mlfabric_row_under_redrawn_rates(tmp_path):
    """mlfabric alone, one epoch, rates redrawn every second: trains, nothing beyond tau_max, rates were redrawn.

    Over TCP: two of ten LTP lab mlfabric jobs this session had a worker exit 2 after training ended (unexplained,
    docs/experiments.md); this test checks the experiment's plumbing and must not inherit that flake.
    """
    res = T.run_tta(rows=("mlfabric",), epochs=1, repeats=1, quick=True, redraw_period_s=1.0, out=str(tmp_path),
                    transport="tcp", progress=False, verbose=False)
    (run,) = res["runs"]
    assert run["error"] is None, run["error"]
    assert run["beyond_tau"] == 0 and run["updates"] > 0 and run["rate_draws"] >= 2
    assert run["target_kind"] == "best common" or run["best_accuracy"] >= 0.95
    assert run["time_to_target_s"] is not None and not run["redraw_errors"]


def test_the_recorded_command_reproduces_the_mlfabric_options():
    p = dict(quick=False, epochs=3, repeats=1, seed=1, transport="tcp", tau_max=4, redraw_period_s=5.0, lr=0.05,
             batch_window_s=0.0, aggregators=2)
    cmd = T._tta_command(p).split()
    for opt, val in (("--tau-max", "4"), ("--lr", "0.05"), ("--batch-window", "0"), ("--aggregators", "2"),
                     ("--transport", "tcp"), ("--redraw-period", "5")):
        assert cmd[cmd.index(opt) + 1] == val
    import argparse

    ap = argparse.ArgumentParser()
    S.register(ap.add_subparsers())
    a = ap.parse_args(cmd[1:])  # what the command line records parses back to the same options
    assert (a.tau_max, a.lr, a.batch_window, a.aggregators, a.experiment) == (4, 0.05, 0.0, 2, "mlfabric")


def test_accuracy_rows_sort_with_the_reference_added_to_what_was_asked():
    runs = [{"row": r, "transport": t, "loss": l} for r, t, l in
            [("hoplite", "tcp", 0.01), ("direct", "tcp", 0.0), ("hoplite", "ltp", 0.0), ("ring", "ltp", 0.01)]]
    assert [(r["row"], r["transport"]) for r in T.order_runs(runs)] == [
        ("direct", "tcp"), ("ring", "ltp"), ("hoplite", "ltp"), ("hoplite", "tcp")]
