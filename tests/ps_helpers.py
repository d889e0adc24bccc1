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


class JobByHand:
    """A rendezvous store and ``ltp-ps server`` / ``ltp-ps worker`` processes started one by one, as a user without
    the launcher would (every process gets ``--store`` and ``common``).  A context manager: on exit every process
    started is stopped and the store goes away.  A process's output is piped (``communicate()`` reads it), or
    dropped with ``quiet=True``."""

    def __init__(self, *common, store_timeout_s: float = 60):
        from ltp_ps import rendezvous as rdv

        port = free_port()
        self.store = rdv.make_store("127.0.0.1", port, is_master=True, timeout_s=store_timeout_s)
        self.common = ["--store", f"127.0.0.1:{port}", *common]
        self.env = child_env()
        self.procs: list = []

    def server(self, *args, quiet: bool = False) -> subprocess.Popen:
        return self._start("server", *args, quiet=quiet)

    def worker(self, rank: int, *args, quiet: bool = False) -> subprocess.Popen:
        return self._start("worker", *args, "--rank", rank, quiet=quiet)

    def _start(self, role: str, *args, quiet: bool) -> subprocess.Popen:
        out = subprocess.DEVNULL if quiet else subprocess.PIPE
        p = subprocess.Popen(ps_cmd(role, *self.common, *args), env=self.env, stdout=out,
                             stderr=subprocess.STDOUT, text=True)
        self.procs.append(p)
        return p

    def __enter__(self) -> "JobByHand":
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            stop(p)
        self.store = None


def rat_job(n_workers, *, wl=None, racks=None, shards=1, board=True, worker_kw=None, buffered_sends=False,
            **server_kw):
    """A ``rat`` job in memory: K shards (colocated with workers 0..K-1 when racks are given) and, with ``board``,
    one tree-view board; returns ``(servers, workers, board)``.  ``buffered_sends``: sends to a stalled process
    complete, as over kernel TCP (:class:`MemoryNetwork`)."""
    from ltp_ps.schedules import World, create
    from ltp_ps.schedules.program import server, worker
    from ltp_ps.schedules.topology import Topology
    from ltp_ps.tree_views import MemoryBoard

    wl = wl or workload()
    net = MemoryNetwork(loss=0.0, segment_size=1024, seed=0, buffered_sends=buffered_sends)
    plan = ShardPlan(wl.n_params, shards)
    topo, placement = None, {}
    if racks is not None:
        names = [f"h{i}" for i in range(n_workers)]
        topo = Topology.uniform(names, rate_bps=100e6, racks=racks, uplink_bps=50e6)
        placement = {**{worker(r): names[r] for r in range(n_workers)}, **{server(k): names[k] for k in range(shards)}}
    mk = lambda me: World(workers=range(n_workers), n_elems=wl.n_params, shards=tuple(plan.ranges),  # noqa: E731
                          layout=tuple(wl.layout()), topology=topo, placement=placement, me=me)
    s_eps = [net.endpoint() for _ in range(shards)]
    w_eps = [net.endpoint() for _ in range(n_workers)]
    addrs = {**{server(k): e.local_addr for k, e in enumerate(s_eps)},
             **{worker(r): e.local_addr for r, e in enumerate(w_eps)}}
    b = MemoryBoard() if board else None
    logs: list = []
    servers = []
    for k in range(shards):
        ps = ParameterServer(wl, s_eps[k], ServerConfig(world_size=n_workers, **server_kw), plan=plan, shard=k,
                             log=logs.append, planner=create("rat", mk(server(k))))
        ps.tree_board = b
        ps.logs = logs
        servers.append(ps)
    workers = []
    for r in range(n_workers):
        for ps in servers:
            ps.admit(r, w_eps[r].local_addr)
        w = Worker(wl, w_eps[r], [ShardRef(k, s_eps[k].local_addr, *plan.ranges[k]) for k in range(shards)],
                   WorkerConfig(rank=r, world_size=n_workers, **(worker_kw or {})), planner=create("rat", mk(worker(r))))
        w.executor.addresses.update(addrs)
        w.tree_board = b
        workers.append(w)
    return servers, workers, b


async def run_rat_job(servers, workers, *, crash_closes=True):
    """Run a ``rat_job`` to the end; every result or exception, PS shards first.  A worker given
    ``max_iterations`` simulates a crash; with ``crash_closes`` its socket goes away with it."""
    async def life(w):
        try:
            return await w.run()
        finally:
            if crash_closes and w.cfg.max_iterations is not None:
                await w.transport.close()

    return await asyncio.gather(*(ps.run() for ps in servers), *(life(w) for w in workers), return_exceptions=True)


def wait_for_rows(proc, out, metrics, *, after_rows: int, within_s: float, who: str) -> int:
    """Wait (up to ``within_s``) until the launch ``proc`` wrote ``after_rows`` iteration rows to ``metrics``;
    returns the pid the launch's output ``out`` gives for ``who`` (``"worker 2"``, ``"ps0"``)."""
    import os
    import re
    import time

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if os.path.exists(metrics) and sum(1 for x in open(metrics) if '"iteration"' in x) >= after_rows:
            break
        assert proc.poll() is None, open(out).read()
        time.sleep(0.05)
    return int(re.findall(rf"\[launch\] started {who} \(pid (\d+)\)", open(out).read())[-1])


def launch_and_kill(args, out, metrics, *, rank: int, after_rows: int, start_s: float, end_s: float) -> str:
    """Run ``ltp-ps launch *args`` (stdout and stderr to ``out``), SIGKILL worker ``rank`` once ``metrics`` has
    ``after_rows`` lines that mention an iteration (within ``start_s``), and wait up to ``end_s`` for the launch.
    Asserts the launch named the killed worker and exited with its signal; returns the launch's output."""
    import os
    import re

    with open(out, "w") as f:
        proc = subprocess.Popen(ps_cmd("launch", *args, "--metrics", metrics), env=child_env(), stdout=f,
                                stderr=subprocess.STDOUT, text=True)
        try:
            pid = wait_for_rows(proc, out, metrics, after_rows=after_rows, within_s=start_s, who=f"worker {rank}")
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
