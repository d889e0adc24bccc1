"""A job that trains nothing never reports success; gather bounds from size and rate; CLI error paths.

In-memory and unit tier (no processes): the end-to-end failure drills are in test_ps_failures_e2e.py.
"""

from __future__ import annotations

import asyncio
import re
import sys

import numpy as np
import pytest

from ltp_ps import cli
from ltp_ps import deadlines as dl
from ltp_ps.deadlines import GatherDeadline
from ltp_ps.errors import ConfigError, TrainingFailed
from ltp_ps.wire import KIND_PARAMS
from ps_helpers import make_job, run_job, workload


# -- the gather bound ---------------------------------------------------------------------------
def test_first_round_bound_uses_the_floor_rate_and_initial_compute():
    d = GatherDeadline()
    b, n = 102_400_000, 6  # ResNet-50-sized float32 gradients, 6 workers
    want = dl.GATHER_BASE_S + dl.COMPUTE_MARGIN * dl.INITIAL_COMPUTE_S + dl.TRANSFER_MARGIN * n * b / (
        dl.FLOOR_RATE_BPS / 8)
    assert d.timeout(b, n) == pytest.approx(want)
    assert d.timeout(b, n) > 200  # the 10 s constant cut every round of this job
    assert "assumed" in d.explain(b, n)


def test_bound_follows_the_lowest_measured_rate_and_slowest_compute():
    d = GatherDeadline(window=3)
    d.observe_compute(0.5)
    d.observe_compute(0.1)
    for rate in (1e9, 50e6, 400e6):  # bytes/s
        d.observe_rate(rate)
    b, n = 10_000_000, 4
    assert d.rate_bytes_per_s == 50e6
    assert d.timeout(b, n) == pytest.approx(dl.GATHER_BASE_S + dl.COMPUTE_MARGIN * 0.5
                                            + dl.TRANSFER_MARGIN * n * b / 50e6)
    for rate in (1e9, 1e9, 1e9):  # the slow sample leaves the window
        d.observe_transfer(rate * 2, 2.0)
    assert d.rate_bytes_per_s == 1e9
    d.observe_rtprop(0.01)
    assert d.timeout(b, n) == pytest.approx(dl.GATHER_BASE_S + dl.COMPUTE_MARGIN * 0.5
                                            + dl.TRANSFER_MARGIN * (n * b / 1e9 + dl.RTT_MULTIPLE * 0.01))
    assert "measured" in d.explain(b, n)


def test_small_model_on_fast_link_settles_near_the_base():
    d = GatherDeadline()
    d.observe_compute(0.005)
    d.observe_transfer(4 * 153_000, 0.004)
    assert dl.GATHER_BASE_S < d.timeout(153_000, 4) < dl.GATHER_BASE_S + 0.1


def test_fixed_bound_overrides_and_bad_values_name_the_fix():
    d = GatherDeadline(1.5)
    d.observe_rate(1.0)
    assert d.timeout(10**9, 8) == 1.5 and "fixed" in d.explain(1, 1)
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="omit --gather-timeout"):
            GatherDeadline(bad)
    d = GatherDeadline()
    d.observe_transfer(0, 1.0)
    d.observe_transfer(10, 0.0)  # degenerate samples are ignored
    d.observe_rate(-5)
    assert d.rate_bytes_per_s == dl.FLOOR_RATE_BPS / 8


def test_broadcast_bound_is_derived_from_size_and_rate_with_a_floor():
    d = GatherDeadline()
    b, n = 102_400_000, 6  # ResNet-50-sized parameters to 6 workers, nothing measured yet: 100 Mbit/s assumed
    want = dl.GATHER_BASE_S + dl.TRANSFER_MARGIN * n * b / (dl.FLOOR_RATE_BPS / 8)
    assert d.broadcast_timeout(b, n) == pytest.approx(want) and want > 150  # a fixed 30 s cut it
    assert d.broadcast_timeout(153_000, 4) == dl.BROADCAST_FLOOR_S  # a small model gets the floor
    d.observe_rate(1e9)  # bytes/s
    d.observe_rtprop(0.02)
    assert d.broadcast_timeout(b, n) == pytest.approx(
        max(dl.BROADCAST_FLOOR_S, dl.GATHER_BASE_S + dl.TRANSFER_MARGIN * (n * b / 1e9 + dl.RTT_MULTIPLE * 0.02)))
    d.observe_rate(1e6)  # a slow sample: the lowest rate rules, as for the gather
    assert d.broadcast_timeout(b, n) > 1000
    assert GatherDeadline(broadcast_fixed_s=7.5).broadcast_timeout(b, n) == 7.5
    for bad in (0, -2.0, float("nan")):
        with pytest.raises(ValueError, match="broadcast_timeout_s at None"):
            GatherDeadline(broadcast_fixed_s=bad)


def test_server_broadcasts_under_the_derived_bound():
    job = make_job(2, iterations=4, lr=0.1)
    ps = job.servers[0]
    asyncio.run(run_job(job))
    msg_bytes = len(ps._params_message(KIND_PARAMS, {}))
    assert ps.executor.payload_timeouts["params"] == pytest.approx(ps.deadline.broadcast_timeout(msg_bytes, 2))
    fixed = make_job(2, iterations=2, lr=0.1, broadcast_timeout_s=4.0)
    asyncio.run(run_job(fixed))
    assert fixed.servers[0].executor.payload_timeouts["params"] == 4.0


def test_broadcast_timeout_option_reaches_the_server_and_bad_values_name_the_fix():
    args = cli.build_parser().parse_args(["launch", "--broadcast-timeout", "4"])
    argv = cli._passthrough(args, cli.SERVER)
    assert argv[argv.index("--broadcast-timeout") + 1] == "4.0"
    assert "--broadcast-timeout" not in cli._passthrough(cli.build_parser().parse_args(["launch"]), cli.SERVER)
    with pytest.raises(ConfigError, match="omit --broadcast-timeout"):
        make_job(1, iterations=1, broadcast_timeout_s=0.0)
    with pytest.raises(ConfigError, match="omit --gather-timeout"):
        make_job(1, iterations=1, gather_timeout_s=-1.0)


def test_server_derives_its_bound_and_learns_from_rounds():
    job = make_job(2, iterations=6, lr=0.1)
    asyncio.run(run_job(job))
    ps = job.servers[0]
    assert ps.deadline.fixed_s is None and ps.deadline._rates and ps.deadline._compute
    assert ps.deadline.timeout(ps.n * 4, 2) < dl.GATHER_BASE_S + dl.COMPUTE_MARGIN * dl.INITIAL_COMPUTE_S


# -- never report success when nothing trained -------------------------------------------------
class _NanAfter:
    """A workload whose loss becomes NaN from the ``k``-th step on (a diverged model)."""

    def __init__(self, wl, k):
        self._wl, self._k, self.calls = wl, k, 0

    def __getattr__(self, name):
        return getattr(self._wl, name)

    def compute(self, model, batch):
        grad, loss, samples = self._wl.compute(model, batch)
        self.calls += 1
        return grad, (float("nan") if self.calls >= self._k else loss), samples


def test_non_finite_loss_stops_the_job_and_keeps_the_good_checkpoint(tmp_path):
    job = make_job(2, wl=_NanAfter(workload(), 7), iterations=50, lr=0.1, checkpoint_dir=str(tmp_path),
                   checkpoint_every=2)
    ps = job.servers[0]

    async def go():
        res = await asyncio.wait_for(run_job_allow_fail(job), 60)
        return res

    res = asyncio.run(go())
    err = res[0]
    assert isinstance(err, TrainingFailed) and "non-finite loss" in str(err) and "lower --lr" in str(err)
    assert ps.iteration < 10
    # the workers were told to stop: none of them is left waiting for parameters
    assert all(isinstance(r, dict) and r["stopped"] for r in res[1:])
    import torch
    st = torch.load(tmp_path / "ps-shard0.pt", weights_only=False)
    assert np.isfinite(st["params"].numpy()).all()
    assert any(r["event"] == "failed" for r in ps.metrics.rows)


async def run_job_allow_fail(job):
    return await asyncio.gather(*(s.run() for s in job.servers), *(w.run() for w in job.workers),
                                return_exceptions=True)


def test_every_worker_gone_stops_with_a_clear_error_not_a_summary():
    # Both workers crash after 3 pushes; the PS must not train on, print a summary and exit 0.
    job = make_job(2, iterations=200, lr=0.1, gather_timeout_s=0.2, max_missed=2, join_timeout_s=0.5,
                   worker_kw={"max_iterations": 3})
    res = asyncio.run(asyncio.wait_for(run_job_allow_fail(job), 60))
    err = res[0]
    assert isinstance(err, TrainingFailed), err
    assert "no usable gradient" in str(err) and "2 rounds in a row" in str(err)
    assert job.servers[0].iteration <= 3 + 2
    drops = [e.reason for e in job.servers[0].membership.events_log if e.kind == "dropped"]
    assert len(drops) == 2
    for reason in drops:  # the real time waited (about the 0.2 s bound), never a made-up 0.00 s
        waited = float(re.search(r"no gradient within (\d+\.\d+) s \(timeout; bound 0\.20 s\)", reason).group(1))
        assert 0.15 <= waited < 5, reason


def test_no_live_worker_and_none_rejoins_fails_naming_the_drop_reasons():
    # Broadcasts to dead endpoints fail at once: every worker is dropped, nobody rejoins.
    job = make_job(2, iterations=200, lr=0.1, gather_timeout_s=0.5, max_missed=5, join_timeout_s=0.3,
                   worker_kw={"max_iterations": 2})

    async def go():
        async def killer():
            while any(w.iterations < 2 for w in job.workers):
                await asyncio.sleep(0.005)
            for t in job.worker_transports:
                job.net.kill(t.local_addr)
        return await asyncio.gather(run_job_allow_fail(job), killer())

    (res, _) = asyncio.run(asyncio.wait_for(go(), 60))
    err = res[0]
    assert isinstance(err, TrainingFailed), err
    msg = str(err)
    assert "no live worker" in msg and "none rejoined within" in msg and "broadcast of round" in msg
    assert "failed after" in msg  # the real elapsed time, not a configured constant


async def _run_killing_at(job, round_index, ranks):
    """Run the job, killing the workers ``ranks`` once the PS reaches ``round_index``; returns the job's results.
    A job that ends before that round returns its own outcome (the killer stops with it) instead of hanging the
    test until its timeout."""
    ps = job.servers[0]

    async def killer():
        while ps.iteration < round_index:
            await asyncio.sleep(0.002)
        for r in ranks:
            job.net.kill(job.worker_transports[r].local_addr)
    kill = asyncio.ensure_future(killer())
    try:
        return await run_job_allow_fail(job)
    finally:
        kill.cancel()


def test_the_only_worker_killed_mid_round_waits_for_a_rejoin_not_an_empty_round_count():
    # Killed while round 5 is in flight: missed once, then its broadcast fails and it is dropped. That
    # round had nobody to ask, so it is not a second "empty round": the PS waits for a rejoin and then
    # fails naming why, instead of "no usable gradient from any of 0 live workers".
    job = make_job(1, epochs=3, lr=0.1, gather_timeout_s=0.3, max_missed=2, join_timeout_s=0.5,
                   worker_kw={"pull_timeout_s": 3.0})

    res = asyncio.run(asyncio.wait_for(_run_killing_at(job, 5, [0]), 60))
    assert isinstance(res[0], TrainingFailed), res[0]
    assert "no live worker at round" in str(res[0]) and "none rejoined within" in str(res[0]), res[0]


@pytest.mark.parametrize("n", [1, 7])
def test_every_worker_killed_in_the_last_round_fails_the_job(n):
    # Nobody delivered the last round: the job did not finish its training, even though fewer than
    # --max-missed rounds were missed and the model of the round before is fine. Stop 52's CI timed out here
    # (7 workers, lr 0.1) with the killer still waiting for round 11, so the test said nothing of the job's state.
    # Not reproduced (four runs beside two busy loops failed the last round as they should). The killer now stops
    # with the job, so a job that ends early fails the test with its own outcome. lr 0.02: the point is the last
    # round, not the accuracy, and 7 workers at lr 0.1 may make the model diverge first (as in the async budget test).
    job = make_job(n, iterations=12, lr=0.02, gather_timeout_s=0.3, max_missed=3, join_timeout_s=0.5,
                   worker_kw={"pull_timeout_s": 3.0})
    res = asyncio.run(asyncio.wait_for(_run_killing_at(job, 11, range(n)), 60))
    assert isinstance(res[0], TrainingFailed), res[0]
    assert "the last round (11) applied no update" in str(res[0]), res[0]


def test_async_mode_every_worker_killed_fails_as_training_failed_naming_the_drops():
    # Was a RendezvousError "only 0 of 1 workers joined ... start the workers" (exit 2, no "failed" row).
    job = make_job(3, epochs=3, lr=0.1, mode="async", momentum=0.0, gather_timeout_s=0.3, max_missed=2,
                   join_timeout_s=0.5, worker_kw={"pull_timeout_s": 3.0})
    ps = job.servers[0]

    async def killer():
        while ps.version < 30:
            await asyncio.sleep(0.002)
        for t in job.worker_transports:
            job.net.kill(t.local_addr)

    async def go():
        return await asyncio.gather(run_job_allow_fail(job), killer())

    (res, _) = asyncio.run(asyncio.wait_for(go(), 60))
    assert isinstance(res[0], TrainingFailed), res[0]
    assert re.search(r"no live worker at version \d+ of 135 and none rejoined", str(res[0])), res[0]
    assert any(r["event"] == "failed" for r in ps.metrics.rows)
    assert sorted(r["rank"] for r in ps.metrics.rows if r["event"] == "dropped") == [0, 1, 2]  # async rows too


def test_async_mode_applies_exactly_its_update_budget():
    # Gradients in flight when the last update lands were applied too (152 updates for a budget of 147 with
    # 7 workers); the summary then claimed more training than the run was asked for. The budget is the point,
    # not the accuracy: at lr 0.1 the 7 stale-gradient workers sometimes collapsed the model (0.41 at epoch 1,
    # 0.10 at epoch 2; one CI run in many), and the PS rightly failed the job. At lr 0.02 two epochs cannot
    # reach the "clearly learned" level a collapse is judged from (ltp_ps.verdict), nor diverge.
    job = make_job(7, epochs=2, lr=0.02, mode="async", momentum=0.0)
    asyncio.run(asyncio.wait_for(run_job(job), 60))
    ps = job.servers[0]
    assert ps.version == ps.total * 7 == ps.staleness.count


def test_async_mode_non_finite_loss_fails():
    job = make_job(2, wl=_NanAfter(workload(), 5), iterations=200, lr=0.05, mode="async", momentum=0.0)
    res = asyncio.run(asyncio.wait_for(run_job_allow_fail(job), 60))
    assert isinstance(res[0], TrainingFailed) and "non-finite loss" in str(res[0])


# -- ltp-ps CLI -------------------------------------------------------------------------------
def test_import_error_inside_the_job_reaches_the_user(monkeypatch):
    async def job():
        import ltp_ps_no_such_module  # noqa: F401 - what a missing scikit-learn looks like

    with pytest.raises(ImportError, match="ltp_ps_no_such_module"):
        cli._run(job())
    monkeypatch.setitem(sys.modules, "uvloop", None)  # no uvloop: same answer on asyncio's loop
    with pytest.raises(ImportError, match="ltp_ps_no_such_module"):
        cli._run(job())

    async def ok():
        return 7

    assert cli._run(ok()) == 7


@pytest.mark.parametrize("opt", [["--loss", "0.01"], ["--rate", "1e9"], ["--delay", "0.003"],
                                 ["--loss", "0.01", "--delay", "0.01"], ["--lab-gro"]])
def test_impairments_without_a_lab_are_an_error_naming_the_fix(opt, capsys):
    rc = cli.main(["launch", "--lab", "off", "--workers", "2", *opt])
    err = capsys.readouterr().err
    assert rc == cli.EXIT_CONFIG
    assert opt[0] in err and "network lab" in err and "tools/install-lab-deps" in err and "loopback" in err


def test_impairments_when_the_lab_is_unsupported_name_the_reason(monkeypatch):
    import ltp_tools.netlab as netlab

    monkeypatch.setattr(netlab, "check_support", lambda: "`nft` not found: apt-get install nftables")
    args = cli.build_parser().parse_args(["launch", "--loss", "0.01"])
    use_lab, why = cli._lab_choice(args)
    assert not use_lab
    with pytest.raises(ConfigError, match="apt-get install nftables"):
        cli._check_impairments(args, use_lab, why)
    cli._check_impairments(cli.build_parser().parse_args(["launch"]), use_lab, why)  # no impairment: fine


@pytest.mark.parametrize("opt, field, value", [
    (["--loss", "1%"], "loss", 0.01), (["--loss", "0.003"], "loss", 0.003),
    (["--rate", "100mbit"], "rate", 100e6), (["--rate", "1gbit"], "rate", 1e9), (["--rate", "2.5e8"], "rate", 2.5e8),
    (["--delay", "20ms"], "delay", 0.02), (["--delay", "0.005"], "delay", 0.005), (["--delay", "500us"], "delay", 5e-4),
])
def test_impairments_take_units_and_bare_numbers_keep_their_meaning(opt, field, value):
    args = cli.build_parser().parse_args(["launch", *opt])
    assert getattr(args, field) == pytest.approx(value)


@pytest.mark.parametrize("opt, says", [
    (["--loss", "1.5"], "outside [0, 1)"), (["--loss", "-0.1"], "outside [0, 1)"), (["--loss", "lots"], "1%"),
    (["--rate", "0"], "positive"), (["--rate", "fast"], "1gbit"), (["--rate", "none"], "leave --rate out"),
    (["--delay", "-1"], "negative"), (["--delay", "soon"], "10ms"),
])
def test_bad_impairment_values_are_refused_naming_the_fix(opt, says, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["launch", *opt])
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("opt, says", [
    (["--epochs", "0"], "number of epochs must be >= 1"), (["--iterations", "0"], "number of rounds must be >= 1"),
    (["--batch-size", "0"], "samples per worker step"), (["--lr", "-1"], "learning rate must be >= 0"),
    (["--momentum", "nan"], "momentum"), (["--weight-decay", "-0.1"], "weight decay"),
    (["--max-missed", "0"], "missed rounds"), (["--epochs", "2.5"], "not a whole number"),
])
def test_bad_training_values_are_refused_before_anything_starts(opt, says, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["launch", *opt])
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("opt, says", [(["--workers", "0"], "--workers must be >= 1"),
                                       (["--num-servers", "0"], "--num-servers must be >= 1")])
def test_launch_refuses_a_job_without_workers_or_ps_instead_of_waiting_forever(opt, says, capsys):
    assert cli.main(["launch", "--lab", "off", *opt]) == cli.EXIT_CONFIG
    assert says in capsys.readouterr().err


def test_ps_restarts_need_a_checkpoint_dir(capsys):
    assert cli.main(["launch", "--lab", "off", "--ps-restarts", "1"]) == cli.EXIT_CONFIG
    assert "--checkpoint-dir" in capsys.readouterr().err


def test_exit_descriptions_name_process_and_signal():
    assert cli._describe_exit("worker 3", 42, -9) == "worker 3 (pid 42) was killed by SIGKILL"
    assert cli._describe_exit("ps0", 7, 3) == "ps0 (pid 7) exited with code 3"
    assert cli._shell_rc(-9) == 137 and cli._shell_rc(-11) == 139 and cli._shell_rc(2) == 2


def test_a_failed_push_costs_the_round_not_the_worker():
    # e.g. LTP's dead-peer rule firing while the PS still waits on another worker's READY note
    from ltp_ps.errors import TransportTimeout

    job = make_job(2, iterations=8, lr=0.1, gather_timeout_s=0.5, max_missed=3)
    w = job.workers[1]
    real_push, failed = w.push, []

    async def flaky_push(*a, **kw):
        if kw["iteration"] == 2 and not failed:
            failed.append(kw["iteration"])
            raise TransportTimeout("peer sent nothing for 1.06 s (registration unanswered)")
        return await real_push(*a, **kw)

    w.push = flaky_push
    res = asyncio.run(asyncio.wait_for(run_job_allow_fail(job), 60))
    assert not any(isinstance(r, BaseException) for r in res), res
    assert failed == [2] and res[2]["stopped"] and w.iterations == 8
    assert w.pushes[2] == [0.0]
    row = [r for r in job.servers[0].metrics.rows if r["event"] == "iteration"][2]
    assert row["contributors"] == 1 and row["delivered"]["1"] == 0.0


def test_torchrun_with_every_process_a_ps_shard_says_so(monkeypatch, capsys):
    """Found by trying to break it: 2 processes with --num-servers 2 said "--workers must be >= 1", an option the
    user never passed."""
    from ltp_ps import run

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert run.main(["--num-servers", "2", "--model", "digits"]) == 2
    err = capsys.readouterr().err
    assert "started 2 processes" in err and "--num-servers 2" in err and "--nproc-per-node 3" in err
