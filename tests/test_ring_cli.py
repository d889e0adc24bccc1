"""``--schedule ring`` end to end over real processes (zero PS), from ``ltp-ps launch`` and torchrun, over TCP
and LTP; ``ltp-ps plan``; clear errors for unknown or PS-less misuse."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from ps_helpers import child_env, free_port, lab_reason, launch_and_kill, ps_cmd

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["tcp", "ltp"])
def test_launch_ring_trains_digits_with_zero_ps(tmp_path, transport):
    summary = tmp_path / "s.json"
    p = subprocess.run(ps_cmd("launch", "--schedule", "ring", "--workers", 3, "--epochs", 8, "--lab", "off",
                              "--transport", transport, "--summary-json", summary),
                       env=child_env(), capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "0 PS + 3 workers" in p.stdout and "[ps" not in p.stdout
    assert len(re.findall(r"\[ring w0\] epoch +\d+/8 +acc", p.stdout)) == 8
    s = json.loads(summary.read_text())
    assert s["final_accuracy"] >= 0.9 and s["iterations"] > 0


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule, transport", [("ring", "ltp"), ("rsgcm", "ltp"), ("ring", "tcp")])
def test_a_ps_less_launch_whose_worker_is_killed_stops_the_rest_at_once(tmp_path, schedule, transport):
    """A PS-less job has no PS to outlive its workers, and its rounds need every one: once one dies the launch
    fails naming it, and every survivor has failed on its own (TCP: its connection broke) or is stopped by the
    launch (LTP: nothing breaks, it would wait out its step timeout). Before: the launch waited forever for
    workers that could not come back; later, for each survivor's own step timeout, a minute by default, so about
    two minutes over LTP."""
    import time

    t0 = time.monotonic()
    text = launch_and_kill(["--schedule", schedule, "--workers", 3, "--epochs", 40, "--lab", "off", "--transport",
                            transport, "--compute-delay", 0.05], tmp_path / "out.txt",
                           tmp_path / "m.jsonl", rank=1, after_rows=3, start_s=60, end_s=30)
    failed = text.split("[launch] FAILED:")[1]
    stopped = re.search(r"stopped ((?:worker \d(?:, )?)+): a --schedule \w+ job has no PS and cannot go on without "
                        r"every worker", failed)
    for rank in (0, 2):
        assert (re.search(rf"worker {rank} \(pid \d+\) exited with code [1-9]", failed)
                or (stopped and f"worker {rank}" in stopped.group(1))), text
    assert time.monotonic() - t0 < 50, text  # well inside the survivors' default 60 s step timeout
    if transport == "tcp":  # a survivor that failed on its own says its neighbour is gone, not "died or stalled"
        assert re.search(r"never arrived; the first input missing this round: worker:\d is gone: its connection "
                         r"closed after [\d.]+ s", text), text


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_lab_impairments_apply_to_a_ps_less_job():
    """--delay (as --loss and --rate) impairs every worker's ingress when there is no PS (before: the flags were
    applied to zero PS hosts, silently)."""
    why = lab_reason()
    if why:
        pytest.skip(why)
    p = subprocess.run(ps_cmd("launch", "--schedule", "ring", "--workers", 2, "--epochs", 1, "--delay", "40ms",
                              "--transport", "tcp"), env=child_env(), capture_output=True, text=True, timeout=170)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (ms,) = [float(x) for x in re.findall(r"reduce +([\d.]+) ms", p.stdout)]
    assert ms >= 80, p.stdout  # two ring steps, each at least one 40 ms crossing


@pytest.mark.parametrize("bad, says", [
    (["--mode", "async"], "runs BSP all-reduce rounds without a PS"),
    (["--kill-worker-after", "3"], "drills a PS dropping a worker"),
    (["--pull-timeout", "0"], "seconds a worker waits for the PS must be > 0"),
    (["--min-workers", "5"], "--min-workers must be in 1..--workers"),
    (["--num-servers", "2"], "--num-servers 2 would be ignored"),  # was silently ignored ("0 PS + 3 workers")
])
def test_ring_launch_refuses_what_it_cannot_run(bad, says):
    p = subprocess.run(ps_cmd("launch", "--schedule", "ring", "--workers", 3, "--lab", "off", *bad),
                       env=child_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize("schedule", ["ring", "rat"])
def test_round_program_schedules_refuse_a_start_without_every_worker(schedule):
    """Their rounds name every worker: --min-workers below --workers would leave the joined ones waiting for the
    absent one's address until --store-timeout, and then fail the job."""
    p = subprocess.run(ps_cmd("launch", "--schedule", schedule, "--workers", 3, "--min-workers", 2, "--lab", "off"),
                       env=child_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "cannot start with --min-workers 2" in p.stderr, p.stdout + p.stderr
    assert "Traceback" not in p.stderr and "[launch] started" not in p.stdout


@pytest.mark.parametrize("args, says", [
    (("--mode", "async"), "--mode async runs with one PS shard"),
    (("--schedule", "mlfabric"), "--schedule mlfabric runs with one PS shard"),  # was a traceback from each shard
    (("--schedule", "hoplite"), "--schedule hoplite runs with one PS shard"),
])
def test_one_shard_schedules_with_several_shards_are_refused_before_anything_starts(args, says):
    p = subprocess.run(ps_cmd("launch", *args, "--num-servers", 2, "--workers", 2, "--lab", "off"),
                       env=child_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stdout + p.stderr
    assert "[launch] started" not in p.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_ring_all_ranks_are_workers():
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
                        "--master-port", str(free_port()), "-m", "ltp_ps.run", "--schedule", "ring", "--model",
                        "digits", "--epochs", "8", "--transport", "tcp"],
                       env=child_env(), capture_output=True, text=True, timeout=280, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "3 workers, no PS" in p.stdout
    acc = [float(a) for a in re.findall(r"acc (\d\.\d+)", p.stdout)]
    assert len(acc) == 8 and acc[-1] >= 0.9


def test_plan_prints_json_with_a_prediction(tmp_path):
    topo = tmp_path / "t.json"
    topo.write_text(json.dumps({"rate_bps": 100e6, "latency_s": 1e-4, "hosts": [f"h{i}" for i in range(6)]}))
    out = {}
    for name in ("direct", "ring"):
        p = subprocess.run(ps_cmd("plan", "--schedule", name, "--topology", topo, "--workers", 5, "--bytes", 4e6),
                           env=child_env(), capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        out[name] = json.loads(p.stdout)
    r, d = out["ring"], out["direct"]
    assert r["apply_at"] == "workers" and d["apply_at"] == "server"
    # direct: per worker, parameters out and the gradient back (no READY note since session 54)
    assert len(r["edges"]) == 2 * 4 * 5 and len(d["edges"]) == 2 * 5
    # 100 Mbit/s, 4 MB: the PS's downlink carries 5 x 4 MB (>= 1.6 s); a ring moves 2 (N-1)/N x 4 MB per host
    assert d["predicted_s"] >= 1.6 and 0.5 < r["predicted_s"] < 0.7
    assert r["plan"]["programs"]["worker:0"]["stages"]


def test_unknown_schedule_lists_what_exists():
    p = subprocess.run(ps_cmd("plan", "--schedule", "nonesuch"), env=child_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2
    assert "unknown schedule 'nonesuch'" in p.stderr and "direct" in p.stderr and "ring" in p.stderr


def test_server_refuses_a_ps_less_schedule():
    p = subprocess.run(ps_cmd("server", "--schedule", "ring", "--store", f"127.0.0.1:{free_port()}"),
                       env=child_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "zero PS processes" in p.stderr
