"""Helpers for the ltp_ps tests: an in-memory job (PS shards + workers in one event loop)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import subprocess
import sys

from ltp_ps.server import ParameterServer, ServerConfig
from ltp_ps.sharding import ShardPlan
from ltp_ps.transport import MemoryNetwork
from ltp_ps.worker import ShardRef, Worker, WorkerConfig
from ltp_ps.workloads import get_workload

_WORKLOADS: dict = {}


def workload(name="digits"):
    if name not in _WORKLOADS:
        _WORKLOADS[name] = get_workload(name)
    return _WORKLOADS[name]


@dataclasses.dataclass
class Job:
    net: MemoryNetwork
    servers: list
    workers: list
    worker_transports: list


def make_job(n_workers=4, *, n_shards=1, loss=0.0, seed=0, wl=None, worker_kw=None, **server_kw) -> Job:
    wl = wl or workload()
    net = MemoryNetwork(loss=loss, segment_size=1024, seed=seed)
    plan = ShardPlan(wl.n_params, n_shards)
    server_kw.setdefault("world_size", n_workers)
    servers = []
    for s in range(n_shards):
        t = net.endpoint()
        servers.append(ParameterServer(wl, t, ServerConfig(**server_kw), plan=plan, shard=s, log=lambda _: None))
    refs = [ShardRef(s.shard, s.transport.local_addr, s.lo, s.hi) for s in servers]
    workers, wts = [], []
    for r in range(n_workers):
        t = net.endpoint()
        for s in servers:
            s.admit(r, t.local_addr)
        workers.append(Worker(wl, t, refs, WorkerConfig(rank=r, world_size=n_workers, **(worker_kw or {}))))
        wts.append(t)
    return Job(net, servers, workers, wts)


async def run_job(job: Job, *extra):
    return await asyncio.gather(*(s.run() for s in job.servers), *(w.run() for w in job.workers), *extra)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**kw) -> dict:
    env = dict(os.environ)
    env.setdefault("LTP_PS_SECRET", "test-secret")
    env["PYTHONUNBUFFERED"] = "1"
    env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    env.update(kw)
    return env


def ps_cmd(*args) -> list:
    return [sys.executable, "-m", "ltp_ps.cli", *map(str, args)]


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch_and_kill(args, out, metrics, *, rank: int, after_rows: int, start_s: float, end_s: float) -> str:
    """Run ``ltp-ps launch *args`` (stdout and stderr to ``out``), SIGKILL worker ``rank`` once ``metrics`` has
    ``after_rows`` lines that mention an iteration (within ``start_s``), and wait up to ``end_s`` for the launch.
    Asserts the launch named the killed worker and exited with its signal; returns the launch's output."""
    import os
    import re
    import time

    with open(out, "w") as f:
        proc = subprocess.Popen(ps_cmd("launch", *args, "--metrics", metrics), env=child_env(), stdout=f,
                                stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + start_s
            while time.monotonic() < deadline:
                if os.path.exists(metrics) and sum(1 for x in open(metrics) if '"iteration"' in x) >= after_rows:
                    break
                assert proc.poll() is None, open(out).read()
                time.sleep(0.05)
            pid = int(re.findall(rf"\[launch\] started worker {rank} \(pid (\d+)\)", open(out).read())[-1])
            os.kill(pid, signal.SIGKILL)
            rc = proc.wait(end_s)
        finally:
            stop(proc)
    text = open(out).read()
    assert rc == 128 + signal.SIGKILL, text  # the launch names the killed child, after the others finished
    assert re.search(rf"\[launch\] FAILED: worker {rank} \(pid \d+\) was killed by SIGKILL", text), text
    return text


def lab_reason() -> str | None:
    """Why the namespace lab cannot run here (a test skips with it), or None."""
    try:
        from ltp_tools.netlab import check_support
    except ImportError as exc:
        return f"ltp_tools.netlab is missing ({exc})"
    return check_support()
