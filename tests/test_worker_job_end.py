"""A worker learns that its PS is gone or that the job ended without waiting out ``--pull-timeout``.

Found with ``ltp-ps launch`` and a SIGSTOPped worker: the PS dropped it while it was stopped; once resumed it
waited for parameters that never came (60 s), outliving the job, and the launch failed it ("did not exit after the
PS finished"); a resumed worker whose PS had exited retried its pushes into ICMP unreachables the same way.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import types

import numpy as np
import pytest
import torch.distributed as dist

from ltp_ps import cli
from ltp_ps.errors import PeerGone, TransportError, TransportTimeout
from ltp_ps.wire import KIND_PARAMS, ParamsHeader

pytestmark = pytest.mark.timeout(60)


class _Forever:
    def __init__(self, finish_after=None):
        self.finish_after = finish_after

    async def run(self):
        if self.finish_after is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.finish_after)
        return {"iterations": 3, "stopped": True}


def _store():
    store = dist.HashStore()
    store.set("server/0", json.dumps({"nonce": "n0"}))
    return store, [types.SimpleNamespace(shard=0, nonce="n0")]


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(cli, "PS_WATCH_S", 0.05)
    monkeypatch.setattr(cli, "JOB_OVER_GRACE_S", 0.3)


async def test_a_worker_still_waiting_when_the_job_ends_stops_after_the_grace(quick):
    store, infos = _store()
    task = asyncio.ensure_future(cli._run_watching(_Forever(), store, infos))
    await asyncio.sleep(0.2)
    assert not task.done()  # nothing ended yet: it waits as long as the job runs
    t0 = time.monotonic()
    store.set("done/0", "1")
    with pytest.raises(TransportError, match="the job ended"):
        await asyncio.wait_for(task, 5)
    assert time.monotonic() - t0 < 2


async def test_a_live_worker_whose_stop_comes_within_the_grace_ends_normally(quick):
    store, infos = _store()
    store.set("done/0", "1")  # written just before the STOP reached this worker
    assert await cli._run_watching(_Forever(finish_after=0.1), store, infos) == {"iterations": 3, "stopped": True}


async def test_a_new_incarnation_still_means_rejoin(quick):
    store, infos = _store()
    task = asyncio.ensure_future(cli._run_watching(_Forever(), store, infos))
    await asyncio.sleep(0.1)
    store.set("server/0", json.dumps({"nonce": "n1"}))
    assert await asyncio.wait_for(task, 5) is None


async def test_a_worker_past_its_rejoin_budget_leaves_when_the_job_ends_not_after_the_store_timeout(quick):
    """Found by a sweep (``ltp-ps launch --mode async --workers 8 --transport tcp --loss 0.2``): workers the live PS
    dropped more often than ``--rejoin`` allows waited ``--store-timeout`` (120 s) for a restarted PS, so they
    outlived the job and the launch failed them ("did not exit after the PS finished").  The wait now ends with
    the job."""
    store, infos = _store()
    task = asyncio.ensure_future(cli._await_restart_or_end(store, infos, 60.0))
    await asyncio.sleep(0.2)
    assert not task.done()
    t0 = time.monotonic()
    store.set("done/0", "1")
    assert await asyncio.wait_for(task, 5) == "over" and time.monotonic() - t0 < 1
    store, infos = _store()
    task = asyncio.ensure_future(cli._await_restart_or_end(store, infos, 60.0))
    store.set("server/0", json.dumps({"nonce": "n1"}))
    assert await asyncio.wait_for(task, 5) == "restarted"
    store, infos = _store()
    assert await cli._await_restart_or_end(store, infos, 0.2) is None  # neither: the caller fails as before


def _worker_with(push_error):
    from ps_helpers import workload
    from ltp_ps.transport import MemoryNetwork
    from ltp_ps.worker import ShardRef, Worker, WorkerConfig

    wl = workload()
    net = MemoryNetwork()
    w = Worker(wl, net.endpoint(), [ShardRef(0, ("mem", 99), 0, wl.n_params)], WorkerConfig(rank=0, world_size=1))
    pulls = []

    async def pull():
        pulls.append(1)
        if len(pulls) > 2:
            raise TransportTimeout("no parameters (test)")
        return [ParamsHeader(KIND_PARAMS, 0, len(pulls), len(pulls), wl.n_params, 0)]

    async def push(grad, **kw):
        raise push_error

    w.pull, w.push = pull, push
    w.flat[:] = wl.initial_params(0)
    return w, pulls


async def test_a_push_that_finds_the_ps_gone_ends_the_run_at_once():
    w, pulls = _worker_with(PeerGone("send to PS: ICMP port unreachable (test)"))
    with pytest.raises(PeerGone):
        await w.run()
    assert len(pulls) == 1  # not another pull (which would wait --pull-timeout)


async def test_a_push_that_times_out_costs_the_round_only():
    w, pulls = _worker_with(TransportTimeout("push not acknowledged in time (test)"))
    with pytest.raises(TransportTimeout, match="no parameters"):
        await w.run()
    assert len(pulls) == 3 and np.isfinite(w.flat).all()


async def test_a_posted_drop_makes_the_worker_rejoin_at_once(quick):
    from ltp_ps import rendezvous as rdv

    store, infos = _store()
    store.add("dropped/0/2", 1)  # an earlier drop, already seen when this worker joined
    seen = {0: rdv.drop_count(store, 0, 2)}
    task = asyncio.ensure_future(cli._run_watching(_Forever(), store, infos, rank=2, drops=seen))
    await asyncio.sleep(0.2)
    store.add("dropped/0/1", 1)  # another worker's drop: not this one's business
    await asyncio.sleep(0.2)
    assert not task.done()
    rdv.ServerRendezvous.mark_dropped(types.SimpleNamespace(store=store, info=infos[0]), 2)
    with pytest.raises(TransportError, match="dropped by PS shard 0"):
        await asyncio.wait_for(task, 5)


def test_a_join_pending_when_the_job_ends_raises_job_ended(monkeypatch):
    import threading

    from ltp_ps import rendezvous as rdv
    from ltp_ps.errors import JobEnded

    monkeypatch.setattr(rdv, "INCARNATION_POLL_S", 0.05)
    store, _ = _store()
    info = rdv.ServerInfo(0, 1, ("127.0.0.1", 1), 0, 10, 10, "float32", 2, "ltp", "bsp", "n0")
    threading.Timer(0.3, lambda: store.set("done/0", "1")).start()  # nobody answers; the job ends
    t0 = time.monotonic()
    with pytest.raises(JobEnded, match="the job ended while worker 1's join"):
        rdv.join(store, b"s" * 32, info, rank=1, addr=("127.0.0.1", 2), n_params=10, dtype="float32",
                 world_size=2, transport="ltp", timeout_s=30)
    assert time.monotonic() - t0 < 5


async def test_the_ps_posts_every_drop_for_the_worker_to_see():
    from ps_helpers import workload
    from ltp_ps.server import ParameterServer, ServerConfig
    from ltp_ps.transport import MemoryNetwork

    posted = []
    ps = ParameterServer(workload(), MemoryNetwork().endpoint(), ServerConfig(world_size=2))
    ps.rendezvous = types.SimpleNamespace(mark_dropped=posted.append)
    ps.admit(0, ("mem", 50))
    ps.admit(1, ("mem", 51))
    ps.membership.failed(1, "test")
    ps._write_member_events(3)
    assert posted == [1]


def _connected_to(port: int, pid: int) -> bool:
    """Whether process ``pid`` holds an established TCP connection to local port ``port`` (``/proc/net/tcp*``)."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # the process is gone
        return False
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in list(f)[1:]:
                col = row.split()
                if col[2].endswith(f":{port:04X}") and col[3] == "01" and col[9] in inodes:
                    return True
    return False


@pytest.mark.timeout(150)
def test_a_worker_whose_store_dies_exits_2_with_a_named_cause_not_a_traceback():
    """Found by trying to break it: under two torchrun agents, killing the PS's node took the agent's TCPStore
    with it, and the workers died of a raw ``DistNetworkError`` traceback (exit 1)."""
    import subprocess

    from ps_helpers import child_env, free_port, ps_cmd, stop

    port = free_port()
    store = subprocess.Popen(ps_cmd("store", "--store", f"127.0.0.1:{port}"), env=child_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    worker = None
    try:
        time.sleep(1.5)  # the store listens
        assert store.poll() is None, store.stdout.read()
        worker = subprocess.Popen(ps_cmd("worker", "--rank", "0", "--store", f"127.0.0.1:{port}", "--transport",
                                         "tcp", "--store-timeout", "30"), env=child_env(),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # it connected and waits for a PS that never comes (its start-up, torch's import included, took over 4 s
        # on a loaded CI machine: a store killed before the connection leaves it retrying for --store-timeout)
        deadline = time.monotonic() + 40
        while not _connected_to(port, worker.pid) and worker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _connected_to(port, worker.pid), "the worker never connected to the store"
        time.sleep(2.0)  # past the store client's handshake, into its wait for the PS
        assert worker.poll() is None, worker.communicate()
        store.kill()
        out, err = worker.communicate(timeout=60)
        assert worker.returncode == 2, (out[-2000:], err[-2000:])
        assert "rendezvous store stopped answering" in err and "Traceback" not in err, err[-2000:]
    finally:
        stop(store)
        if worker is not None:
            stop(worker)
