"""End-to-end over real processes and kernel TCP: launch, failures, torchrun, DDP hook, lab."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import tokenize

import pytest

from ltp_ps.metrics import read_jsonl
from ps_helpers import child_env, free_port, lab_reason, ps_cmd, stop

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_launch_digits_four_workers_over_tcp(tmp_path):
    summary, metrics = tmp_path / "s.json", tmp_path / "m.jsonl"
    p = subprocess.run(ps_cmd("launch", "--workers", 4, "--epochs", 10, "--model", "digits", "--lab", "off",
                              "--transport", "tcp", "--cc", "cubic", "--summary-json", summary, "--metrics", metrics),
                       env=child_env(), capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stdout + p.stderr
    assert len(re.findall(r"epoch +\d+/10 +acc \d\.\d{4} +loss \d+\.\d{4} ", p.stdout)) == 10
    assert "batch sync mean" in p.stdout and "delivered fraction" in p.stdout
    s = json.loads(summary.read_text())
    assert s["final_accuracy"] >= 0.95
    rows = read_jsonl(str(metrics))
    it = [r for r in rows if r["event"] == "iteration"]
    assert len(it) == s["iterations"] and all(set(r["delivered"]) == {"0", "1", "2", "3"} for r in it)
    assert all(r["gather_s"] >= 0 and r["broadcast_s"] > 0 and r["regime"]["0"] == "complete" for r in it)


@pytest.mark.parametrize("schedule", ["direct", "ring", "hoplite"])
def test_synthetic_gradients_report_no_loss(tmp_path, schedule):
    """A synthetic workload has no training loss: its epoch lines say '-' and its metrics NaN, not 0.0000."""
    metrics = tmp_path / "m.jsonl"
    p = subprocess.run(ps_cmd("launch", "--workers", 2, "--epochs", 2, "--model", "synthetic:20000", "--lab", "off",
                              "--transport", "tcp", "--schedule", schedule, "--metrics", metrics),
                       env=child_env(), capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stdout + p.stderr
    assert len(re.findall(r"epoch +\d/2 +loss - ", p.stdout)) == 2, p.stdout
    assert "loss 0.0000" not in p.stdout
    epochs = [r for r in read_jsonl(str(metrics)) if r["event"] == "epoch"]
    assert epochs and all(r["loss"] != r["loss"] for r in epochs)


def _wait_rows(path, pred, timeout, proc):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            rows = read_jsonl(path)
            if pred(rows):
                return rows
        if proc.poll() is not None:
            raise AssertionError(f"server exited early: {proc.stdout.read()}")
        time.sleep(0.1)
    raise AssertionError("timed out waiting for the PS's metrics")


def test_killed_worker_is_dropped_restarted_worker_rejoins_and_bad_workers_are_refused(tmp_path):
    port = free_port()
    metrics = str(tmp_path / "m.jsonl")
    common = ["--store", f"127.0.0.1:{port}", "--workers", 3, "--model", "digits", "--transport", "tcp",
              "--compute-delay", 0.1]  # slow enough that the restarted worker is back before the end (on a loaded box)
    env = child_env()
    server = subprocess.Popen(ps_cmd("server", "--store-master", *common, "--epochs", 12, "--gather-timeout", 1,
                                     "--max-missed", 2, "--metrics", metrics, "--summary-json", tmp_path / "s.json",
                                     "--store-timeout", 60),
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    procs = [server]
    try:
        time.sleep(0.5)
        bad = subprocess.run(ps_cmd("worker", *common, "--rank", 0), env=child_env(LTP_PS_SECRET="wrong"),
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "secret" in bad.stderr and "LTP_PS_SECRET" in bad.stderr
        wrong_model = subprocess.run(ps_cmd("worker", *[c if c != "digits" else "synthetic:1000" for c in common],
                                            "--rank", 0), env=env, capture_output=True, text=True, timeout=60)
        assert wrong_model.returncode == 2 and "model size mismatch" in wrong_model.stderr
        workers = {r: subprocess.Popen(ps_cmd("worker", *common, "--rank", r), env=env) for r in range(3)}
        procs += list(workers.values())
        _wait_rows(metrics, lambda rows: sum(r["event"] == "iteration" for r in rows) >= 20, 90, server)
        workers[1].send_signal(signal.SIGKILL)  # dies mid-iteration
        workers[1].wait()
        _wait_rows(metrics, lambda rows: any(r["event"] == "dropped" for r in rows), 30, server)
        workers[1] = subprocess.Popen(ps_cmd("worker", *common, "--rank", 1), env=env)
        procs.append(workers[1])
        out, _ = server.communicate(timeout=120)
        assert server.returncode == 0, out
        rows = read_jsonl(metrics)
        events = [(r["event"], r.get("rank")) for r in rows if r["event"] in ("refused", "dropped", "rejoined")]
        assert ("dropped", 1) in events and ("rejoined", 1) in events
        assert [e for e in events if e[0] == "refused"], "the misconfigured worker must show up as refused"
        last = [r for r in rows if r["event"] == "iteration"][-1]
        assert set(last["delivered"]) == {"0", "1", "2"}  # the restarted worker is back in the gather
        s = json.loads((tmp_path / "s.json").read_text())
        assert s["final_accuracy"] >= 0.93
        for r, w in workers.items():
            assert w.wait(30) == 0
    finally:
        for p in procs:
            stop(p)


def test_torchrun_one_ps_two_workers():
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
                        "--master-port", str(free_port()), "-m", "ltp_ps.run", "--model", "digits", "--epochs", "6",
                        "--transport", "tcp", "--cc", "reno"],
                       env=child_env(), capture_output=True, text=True, timeout=150, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "(tcp/reno)" in p.stdout
    acc = [float(a) for a in re.findall(r"acc (\d\.\d+)", p.stdout)]
    assert len(acc) == 6 and acc[-1] >= 0.9


def test_ddp_example_switches_to_ltp_hook_with_one_line():
    script = os.path.join(REPO, "ps", "examples", "ddp_digits.py")
    with open(script, "rb") as f:  # code lines naming ltp_ps: the import and the hook registration
        lines = {t.start[0] for t in tokenize.tokenize(f.readline) if t.type == tokenize.NAME and t.string == "ltp_ps"}
    assert len(lines) == 2
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", str(free_port()), script, "--epochs", "8"],
                       env=child_env(LTP_PS_TRANSPORT="tcp"), capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "ltp_ps.ddp: gradient buckets of 2 ranks averaged by a PS" in p.stdout
    acc = [float(a) for a in re.findall(r"test accuracy (\d\.\d+)", p.stdout)]
    assert len(acc) == 8 and max(acc[-3:]) >= 0.95


@pytest.mark.netns
def test_launch_in_lab_with_one_percent_loss_over_tcp(tmp_path):
    reason = lab_reason()
    if reason:
        pytest.skip(reason)
    summary = tmp_path / "s.json"
    p = subprocess.run(ps_cmd("launch", "--workers", 4, "--epochs", 10, "--lab", "on", "--loss", 0.01,
                              "--delay", 0.001, "--transport", "tcp", "--cc", "bbr", "--summary-json", summary),
                       env=child_env(), capture_output=True, text=True, timeout=170)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "[launch] lab" in p.stdout
    s = json.loads(summary.read_text())
    assert s["final_accuracy"] >= 0.95 and s["delivered_min"] == 1.0  # TCP retransmits what the lab drops
