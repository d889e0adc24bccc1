"""Failure drills on real processes (loopback): killed PS restarted from its checkpoint, killed PS or
worker failing the launch with the process and signal named, a job whose workers all died exiting 3."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from ltp_ps.metrics import read_jsonl
from ps_helpers import child_env, ps_cmd, stop

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


class Launch:
    """``ltp-ps launch`` in the background, its output in a file, its children's pids parsed."""

    def __init__(self, tmp_path, *args):
        self.out = tmp_path / "launch.out"
        self.metrics = str(tmp_path / "m.jsonl")
        self._f = open(self.out, "w")
        self.proc = subprocess.Popen(ps_cmd("launch", "--lab", "off", "--metrics", self.metrics, *args),
                                     env=child_env(), stdout=self._f, stderr=subprocess.STDOUT, text=True)

    def text(self) -> str:
        return self.out.read_text()

    def pid(self, name: str) -> int:
        return int(re.findall(rf"\[launch\] started {name} \(pid (\d+)\)", self.text())[-1])

    def iterations(self) -> list[int]:
        if not os.path.exists(self.metrics):
            return []
        return [r["iteration"] for r in read_jsonl(self.metrics) if r["event"] == "iteration"]

    def wait_iterations(self, n: int, timeout: float = 120) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            its = self.iterations()
            if len(its) >= n:
                return its[-1]
            assert self.proc.poll() is None, self.text()
            time.sleep(0.05)
        raise AssertionError(f"no {n} iterations within {timeout} s:\n{self.text()}")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            stop(self.proc)
            self._f.close()


@pytest.mark.parametrize("transport", ["tcp", "ltp"])
def test_killed_ps_restarts_from_its_checkpoint_and_workers_rejoin(tmp_path, transport):
    every = 5
    job = Launch(tmp_path, "--transport", transport, "--workers", 2, "--epochs", 4, "--compute-delay", 0.02,
                 "--checkpoint-dir", tmp_path / "ck", "--checkpoint-every", every, "--ps-restarts", 1,
                 "--summary-json", tmp_path / "s.json")
    killed_at = job.wait_iterations(23)
    os.kill(job.pid("ps0"), signal.SIGKILL)
    t_kill = time.monotonic()
    rc = job.wait(200)
    out = job.text()
    assert rc == 0, out
    assert re.search(r"ps0 \(pid \d+\) was killed by SIGKILL; restarting it", out), out
    resumed = int(re.search(r"resumed from checkpoint at iteration (\d+)", out).group(1))
    assert killed_at + 1 - every <= resumed <= killed_at + 1  # lost at most one checkpoint interval
    rows = read_jsonl(job.metrics)
    first_join_again = [i for i, r in enumerate(rows) if r["event"] == "join" and r["iteration"] == resumed][-2]
    after = [r["iteration"] for r in rows[first_join_again:] if r["event"] == "iteration"]
    assert after == list(range(resumed, after[-1] + 1)), (resumed, after[:5])  # no round skipped
    assert set(r["rank"] for r in rows[first_join_again:] if r["event"] == "join") == {0, 1}  # both rejoined
    assert after[-1] + 1 == 4 * (after[-1] + 1) // 4 and "final / best accuracy" in out
    print(f"{transport}: killed at {killed_at}, resumed at {resumed}, back in {time.monotonic() - t_kill:.1f} s")


def test_killed_ps_without_restarts_fails_the_launch_naming_it(tmp_path):
    job = Launch(tmp_path, "--transport", "tcp", "--workers", 2, "--epochs", 20, "--compute-delay", 0.02)
    job.wait_iterations(5)
    os.kill(job.pid("ps0"), signal.SIGKILL)
    t0 = time.monotonic()
    rc = job.wait(60)
    out = job.text()
    assert rc == 128 + signal.SIGKILL, out
    assert re.search(r"\[launch\] FAILED: ps0 \(pid \d+\) was killed by SIGKILL", out), out
    assert time.monotonic() - t0 < 20  # the workers are not left waiting for a PS that is gone


def test_killed_worker_fails_the_launch_naming_it_while_the_rest_finish(tmp_path):
    job = Launch(tmp_path, "--transport", "tcp", "--workers", 3, "--epochs", 3, "--compute-delay", 0.02,
                 "--summary-json", tmp_path / "s.json")
    job.wait_iterations(5)
    os.kill(job.pid("worker 1"), signal.SIGKILL)
    rc = job.wait(150)
    out = job.text()
    assert rc == 128 + signal.SIGKILL, out
    assert re.search(r"\[launch\] FAILED: worker 1 \(pid \d+\) was killed by SIGKILL", out), out
    assert "final / best accuracy" in out  # the PS finished with the two others
    assert os.path.exists(tmp_path / "s.json")


def test_every_worker_killed_ends_the_launch_instead_of_waiting_for_rejoins(tmp_path):
    job = Launch(tmp_path, "--transport", "tcp", "--workers", 2, "--epochs", 20, "--compute-delay", 0.02)
    job.wait_iterations(5)
    for name in ("worker 0", "worker 1"):
        os.kill(job.pid(name), signal.SIGKILL)
    t0 = time.monotonic()
    rc = job.wait(90)
    out = job.text()
    assert rc == 128 + signal.SIGKILL, out
    assert "no worker can rejoin" in out and re.search(r"FAILED: worker \d \(pid \d+\) was killed by SIGKILL", out)
    assert time.monotonic() - t0 < 40  # not the PS's --store-timeout (120 s) rejoin wait
    assert "final / best accuracy" not in out


def test_job_whose_only_worker_died_exits_3_not_0(tmp_path):
    # Over TCP the PS's next broadcast to the exited worker fails: the worker is dropped at once, and the
    # PS waits --store-timeout for it to rejoin before it gives up.
    job = Launch(tmp_path, "--transport", "tcp", "--workers", 1, "--epochs", 20, "--kill-worker-after", 3,
                 "--gather-timeout", 0.5, "--max-missed", 2, "--store-timeout", 20)
    rc = job.wait(120)
    out = job.text()
    assert rc == 3, out
    assert "ltp-ps: training failed" in out and "no live worker at round" in out, out
    assert re.search(r"none rejoined within 2\d\.\d s \(worker 0: broadcast of round \d+ failed after", out), out
    assert re.search(r"\[launch\] FAILED: ps0 \(pid \d+\) exited with code 3", out), out
    assert "final / best accuracy" not in out  # no summary for a job that trained nothing


def test_worker_under_a_failed_ps_exits_non_zero(tmp_path):
    """A worker stopped by a PS that failed must not exit 0 (it reads failed/<s> from the store)."""
    from ps_helpers import JobByHand

    with JobByHand("--workers", 1, "--model", "digits", "--transport", "tcp", "--store-timeout", 30,
                   store_timeout_s=30) as job:
        server = job.server("--epochs", 5, "--lr", "1e38")  # diverges at once (inf itself is refused)
        worker = job.worker(0)
        s_out, _ = server.communicate(timeout=120)
        w_out, _ = worker.communicate(timeout=60)
        assert server.returncode == 3 and "non-finite" in s_out, s_out
        assert worker.returncode == 3 and "PS shard 0 stopped the job" in w_out, w_out


@pytest.mark.parametrize("transport", ["tcp", "ltp"])
def test_launch_at_chance_accuracy_with_a_finite_loss_exits_3_naming_why(tmp_path, transport):
    """``--lr 1e9`` with the norm guard on: every loss finite, the model guessing; PS, workers and launch fail."""
    job = Launch(tmp_path, "--transport", transport, "--workers", 2, "--epochs", 3, "--lr", "1e9",
                 "--batch-size", 256)  # 3 rounds an epoch: the verdict needs 3 epochs, not many rounds
    rc = job.wait(180)
    out = job.text()
    assert rc == 3, out
    # its test loss is ~1e15, far above a uniform guess's: the verdict's "diverged" rule names it
    assert re.search(r"ltp-ps: training failed: PS shard 0: training diverged: test accuracy 0\.\d+ at epoch 3 is at "
                     r"chance .* Check --lr", out), out
    assert re.search(r"\[launch\] FAILED: .*ps0 \(pid \d+\) exited with code 3", out), out
    assert out.count("PS shard 0 stopped the job") == 2, out  # both workers read the verdict, before STOP
    assert "final / best accuracy" not in out


@pytest.mark.parametrize("mode", ["async", "bsp"])
def test_a_drilled_worker_is_announced_and_its_drop_logged_and_the_job_goes_on(tmp_path, mode):
    """``--kill-worker-after 3``: the launch says which worker the drill stops and when it left; the PS logs
    the drop with its cause in either mode (the asynchronous PS dropped it silently before), and the job
    finishes with the other workers."""
    job = Launch(tmp_path, "--transport", "tcp", "--workers", 3, "--epochs", 2, "--mode", mode,
                 "--kill-worker-after", 3)
    rc = job.wait(150)
    out = job.text()
    assert rc == 0, out
    assert "[launch] drill (--kill-worker-after): worker 0 leaves the job after 3 iterations" in out, out
    assert re.search(r"\[launch\] worker 0 \(pid \d+\) left after 3 iterations, as drilled", out), out
    assert re.search(r"\[ps0\] dropped worker 0: ", out), out
    assert "dropped worker 1" not in out and "dropped worker 2" not in out, out
    assert "final / best accuracy" in out and "workers 2" in out, out
