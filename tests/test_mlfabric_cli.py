"""MLfabric's CLI options (``--tau-max``, ``--aggregators``, ``--batch-window``, ``--t-lag``): parsing, validation
(exit 2 with the fix named) and that the values reach the planner, the controller and the run-time driver."""

from __future__ import annotations

import json
import subprocess

import pytest

from ltp_ps import cli, run as torchrun_entry, schedule_cli
from ltp_ps.errors import ConfigError
from ltp_ps.sharding import ShardPlan
from ltp_ps.workloads import get_workload
from ps_helpers import child_env, free_port, ps_cmd

GOOD = ["--tau-max", "3", "--aggregators", "2", "--batch-window", "0.05", "--t-lag", "0.5"]


@pytest.mark.parametrize("argv", [["server"], ["worker"], ["launch"], ["plan"]])
def test_every_role_parses_the_options(argv):
    a = cli.build_parser().parse_args(argv + ["--schedule", "mlfabric"] + GOOD)
    assert (a.tau_max, a.aggregators, a.batch_window, a.t_lag) == (3, 2, 0.05, 0.5)
    d = cli.build_parser().parse_args(argv)
    assert (d.tau_max, d.aggregators, d.batch_window, d.t_lag) == (None, None, None, None)  # schedule defaults


def test_torchrun_entry_parses_the_options():
    a = torchrun_entry.build_parser().parse_args(["--schedule", "mlfabric"] + GOOD)
    assert schedule_cli.schedule_options(a) == {"tau_max": 3, "k": 2, "batch_window_s": 0.05, "t_lag_s": 0.5}


@pytest.mark.parametrize("opt,value,fix", [("--tau-max", "0", "--tau-max 8"), ("--tau-max", "-3", "--tau-max 8"),
                                           ("--tau-max", "2.5", "--tau-max 8"), ("--aggregators", "-1",
                                                                                 "--aggregators 1"),
                                           ("--aggregators", "x", "--aggregators 1"),
                                           ("--batch-window", "-0.1", "--batch-window 0.1"),
                                           ("--batch-window", "nan", "--batch-window 0.1"),
                                           ("--t-lag", "0", "--t-lag 1"), ("--t-lag", "inf", "--t-lag 1"),
                                           ("--t-lag", "soon", "--t-lag 1"), ("--rat-chunks", "0", "--rat-chunks 4"),
                                           ("--rat-chunks", "100000", "< 1025")])
def test_bad_values_exit_2_naming_the_fix(capsys, opt, value, fix):
    """(--rat-chunks 100000 was found by trying to break it: it overflowed the tag's step field in every role,
    three tracebacks)"""
    schedule = "rat" if opt == "--rat-chunks" else "mlfabric"
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["server", "--schedule", schedule, opt, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert opt in err and fix in err


def _args(*extra, workers=4):
    return cli.build_parser().parse_args(["server", "--workers", str(workers), *extra])


def test_options_with_another_schedule_are_refused_not_ignored():
    for sched in ("direct", "ring", "rsgcm", "rat"):
        with pytest.raises(ConfigError, match="only to --schedule mlfabric.*pass --schedule mlfabric"):
            schedule_cli.schedule_options(_args("--schedule", sched, "--t-lag", "2"))
        with pytest.raises(ConfigError):
            schedule_cli.schedule_class(_args("--schedule", sched, "--tau-max", "2"))  # every role checks first
    assert schedule_cli.schedule_options(_args("--schedule", "direct")) == {}


def test_more_aggregators_than_workers_is_refused():
    with pytest.raises(ConfigError, match="pass --aggregators between 0 and 3"):
        schedule_cli.schedule_options(_args("--schedule", "mlfabric", "--aggregators", "4", workers=3))
    assert schedule_cli.schedule_options(_args("--schedule", "mlfabric", "--aggregators", "3", workers=3)) == {"k": 3}


def test_values_reach_the_planner_controller_and_driver_period():
    wl = get_workload("synthetic:64")
    args = _args("--schedule", "mlfabric", *GOOD)
    planner = schedule_cli.server_planner(args, wl, ShardPlan(wl.n_params, 1), 0)
    assert (planner.tau_max, planner.k, planner.batch_window_s, planner.t_lag_s) == (3, 2, 0.05, 0.5)
    ctrl = planner.controller()
    assert (ctrl.tau_max, ctrl.k, ctrl.batch_window_s) == (3, 2, 0.05)
    dflt = schedule_cli.server_planner(_args("--schedule", "mlfabric"), wl, ShardPlan(wl.n_params, 1), 0)
    assert (dflt.tau_max, dflt.k, dflt.batch_window_s, dflt.t_lag_s) == (8, 1, 0.1, None)


def test_schedule_refuses_bad_values_through_the_api():
    from ltp_ps.schedules import World, create

    w = World(workers=range(3), n_elems=16, shards=((0, 16),))
    for kw in ({"tau_max": 0}, {"k": -1}, {"batch_window_s": -1.0}, {"t_lag_s": 0.0}, {"t_lag_s": float("nan")}):
        with pytest.raises(ValueError, match="must be"):
            create("mlfabric", w, **kw)


def test_launch_hands_the_options_to_every_child():
    a = cli.build_parser().parse_args(["launch", "--schedule", "mlfabric"] + GOOD)
    argv = cli._passthrough(a, cli.COMMON)
    for opt, val in zip(GOOD[::2], GOOD[1::2]):
        assert argv[argv.index(opt) + 1] == val
    assert "--tau-max" not in cli._passthrough(cli.build_parser().parse_args(["launch"]), cli.COMMON)


def test_plan_command_plans_with_the_options(capsys):
    a = cli.build_parser().parse_args(["plan", "--schedule", "mlfabric", "--workers", "5", "--summary", "--bytes",
                                       "4000", "--tau-max", "2", "--aggregators", "2"])
    assert schedule_cli.plan_main(a) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schedule"] == "mlfabric" and out["predicted_s"] > 0


def test_plan_notes_carry_tau_and_k():
    from ltp_ps.schedules import World, create

    w = World(workers=range(5), n_elems=1000, shards=((0, 1000),))
    notes = create("mlfabric", w, tau_max=2, k=2).plan(0).notes
    assert (notes["tau_max"], notes["k"]) == (2, 2)


def test_server_process_refuses_an_option_for_another_schedule():
    p = subprocess.run(ps_cmd("server", "--schedule", "direct", "--aggregators", "2", "--store",
                              f"127.0.0.1:{free_port()}"), env=child_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and "pass --schedule mlfabric" in p.stderr, p.stderr
