"""``--schedule rat`` (a PS-side tree schedule) end to end over real processes: launch (TCP, LTP) and torchrun;
the CLI refuses schedules whose PS loop is not wired, naming what works."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from ps_helpers import child_env, free_port, ps_cmd

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["tcp", "ltp"])
def test_launch_rat_trains_digits(tmp_path, transport):
    summary = tmp_path / "s.json"
    p = subprocess.run(ps_cmd("launch", "--schedule", "rat", "--workers", 4, "--epochs", 10, "--lab", "off",
                              "--transport", transport, "--summary-json", summary),
                       env=child_env(), capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert len(re.findall(r"\[ps0\] epoch +\d+/10 +acc", p.stdout)) == 10
    s = json.loads(summary.read_text())
    assert s["final_accuracy"] >= 0.9


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_rat():
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                        "--master-port", str(free_port()), "-m", "ltp_ps.run", "--schedule", "rat", "--model",
                        "digits", "--epochs", "10", "--transport", "tcp"],
                       env=child_env(), capture_output=True, text=True, timeout=280, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    acc = [float(a) for a in re.findall(r"acc (\d\.\d+)", p.stdout)]
    assert len(acc) == 10 and acc[-1] >= 0.9


def test_server_refuses_async_trees():
    p = subprocess.run(ps_cmd("server", "--schedule", "rat", "--mode", "async", "--store",
                              f"127.0.0.1:{free_port()}"), env=child_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and "--mode bsp" in p.stderr


@pytest.mark.timeout(120)
def test_a_topology_smaller_than_the_job_is_a_config_error_not_a_traceback(tmp_path):
    """Found by trying to break it: 3 hosts for a PS + 4 workers raised a raw KeyError (exit 1) in every process."""
    topo = tmp_path / "three.json"
    topo.write_text(json.dumps({"rate_bps": 1e9, "latency_s": 1e-4,
                                "hosts": [{"name": f"h{i}", "rack": i} for i in range(3)],
                                "uplinks": [{"rack": i, "rate_bps": 5e8} for i in range(3)]}))
    p = subprocess.run(ps_cmd("launch", "--workers", "4", "--schedule", "rat", "--epochs", "1", "--topology", str(topo),
                              "--lab", "off"), env=child_env(), capture_output=True, text=True, timeout=110)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "Traceback" not in out, out[-3000:]
    assert "3 hosts for 5 nodes; no host for worker:2, worker:3" in out and "exited with code 2" in out, out[-3000:]


@pytest.mark.parametrize("argv, want", [
    ([], 0.9), (["--mode", "async"], 0.0), (["--schedule", "mlfabric"], 0.0),
    (["--schedule", "hoplite", "--mode", "async"], 0.0), (["--schedule", "ring"], 0.9), (["--schedule", "rat"], 0.9),
    (["--mode", "async", "--momentum", "0.5"], 0.5), (["--momentum", "0"], 0.0),
])
def test_momentum_defaults_to_zero_for_asynchronous_updates_only(argv, want):
    from ltp_ps import cli as ps_cli

    args = ps_cli.build_parser().parse_args(["launch", *argv])
    from ltp_ps import schedule_cli

    assert schedule_cli.momentum_for(args) == want


def test_the_store_resolver_finds_published_workers_only_and_survives_a_store_that_is_gone():
    """``Executor.resolve`` of controller-schedule workers: a worker's signed address once it published it, None for
    a server node or a worker not (yet) published, None once the store is gone (the job ended), and a clear
    error for an address signed with another secret."""
    from ltp_ps import schedule_cli
    from ltp_ps.errors import RendezvousError

    class Store(dict):
        gone = False

        def check(self, keys):
            if self.gone:
                raise RuntimeError("connection refused")  # what a vanished TCPStore raises (DistNetworkError)
            return all(k in self for k in keys)

        def get(self, k):
            return self[k]

        def set(self, k, v):
            self[k] = v.encode() if isinstance(v, str) else v

    store = Store()
    resolve = schedule_cli.store_resolver(store, b"s3cret")
    assert resolve("worker:2") is None and resolve("server:0") is None
    store.set("tree/2", schedule_cli._sign(b"s3cret", {"rank": 2, "addr": ["10.0.0.2", 7447]}))
    assert resolve("worker:2") == ("10.0.0.2", 7447)
    store.set("tree/3", schedule_cli._sign(b"other", {"rank": 3, "addr": ["10.0.0.3", 7447]}))
    with pytest.raises(RendezvousError, match="LTP_PS_SECRET"):
        resolve("worker:3")
    store.gone = True
    assert resolve("worker:2") is None
