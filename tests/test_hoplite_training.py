"""Hoplite end to end: the PS's directory drives ParameterServer + Worker rounds (in memory, then launch)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from ltp_ps.schedules import World, create
from ltp_ps.schedules.program import server, worker
from ltp_ps.server import ParameterServer, ServerConfig
from ltp_ps.sharding import ShardPlan
from ltp_ps.transport import MemoryNetwork
from ltp_ps.worker import ShardRef, Worker, WorkerConfig
from ps_helpers import child_env, free_port, launch_and_kill, ps_cmd, workload

pytestmark = pytest.mark.timeout(120)

PIECE_BYTES = [None, 16 * 1024]  # the digits model (153 kB) whole (below REDUCE_PIECE_BYTES), or in 10 pieces


@pytest.fixture(params=PIECE_BYTES, ids=["whole", "pieces"])
def piece_bytes(request, monkeypatch):
    """The reduce's piece size the planners hand their controllers (cut-through reduce when set)."""
    from ltp_ps.schedules import hoplite

    monkeypatch.setattr(hoplite, "REDUCE_PIECE_BYTES", request.param)
    return request.param


def make_job(n_workers, *, loss=0.0, seed=0, schedule="hoplite", **server_kw):
    wl = workload()
    net = MemoryNetwork(loss=loss, segment_size=1024, seed=seed)
    plan = ShardPlan(wl.n_params, 1)
    world = World(workers=range(n_workers), n_elems=wl.n_params, shards=tuple(plan.ranges),
                  layout=tuple(wl.layout()))
    s_ep = net.endpoint()
    w_eps = [net.endpoint() for _ in range(n_workers)]
    addrs = {server(0): s_ep.local_addr, **{worker(r): e.local_addr for r, e in enumerate(w_eps)}}
    ps = ParameterServer(wl, s_ep, ServerConfig(world_size=n_workers, **server_kw), plan=plan, shard=0,
                         log=lambda _: None, planner=create(schedule, world))
    refs = [ShardRef(0, s_ep.local_addr, ps.lo, ps.hi)]
    workers = []
    for r in range(n_workers):
        ps.admit(r, w_eps[r].local_addr)
        w = Worker(wl, w_eps[r], refs, WorkerConfig(rank=r, world_size=n_workers), planner=create(schedule, world))
        w.executor.addresses.update(addrs)
        workers.append(w)
    return ps, workers


@pytest.mark.parametrize("n_workers", [2, 3, 5])
async def test_hoplite_trains_digits_in_memory(n_workers, piece_bytes):
    # at least ~90 rounds whatever the worker count: 5 workers x 6 epochs made only 54, and ended at 0.897-0.906
    # depending on torch's thread count (float summation order), too close to the 0.9 bar
    ps, workers = make_job(n_workers, epochs=max(6, 2 * n_workers), lr=0.1)
    ps_ctrl = ps.planner.controller()
    ps_ctrl.start(0, [worker(r) for r in range(n_workers)], now=0.0)
    assert len(ps_ctrl.reduces) == (10 if piece_bytes else 1)
    out = await asyncio.gather(ps.run(), *(w.run() for w in workers))
    assert all(o.get("stopped") for o in out[1:])
    ev = workload().evaluate(ps.params)
    assert ev["accuracy"] >= 0.9, ev
    rows = [r for r in ps.metrics.rows if r["event"] == "iteration"]
    assert rows and all(r["schedule"] == "hoplite" and r["contributors"] == n_workers for r in rows)
    assert len(rows) == ps.total


async def test_hoplite_round_closes_without_a_dead_worker(piece_bytes):
    """A worker that stops answering mid-run is written off: later rounds close with the others' contributions."""
    ps, workers = make_job(4, epochs=3, lr=0.1, join_timeout_s=5.0)
    victim = workers[1]
    victim.cfg.pull_timeout_s = 60.0

    async def kill_after(n):
        while len([r for r in ps.metrics.rows if r["event"] == "iteration"]) < n:
            await asyncio.sleep(0.005)
        tasks[1].cancel()  # the victim stops mid-run: no more events, grants or transfers
        await victim.transport.close()

    tasks = [asyncio.ensure_future(w.run()) for w in workers]
    await asyncio.gather(ps.run(), kill_after(5))
    outs = await asyncio.gather(*tasks, return_exceptions=True)
    rows = [r for r in ps.metrics.rows if r["event"] == "iteration"]
    assert len(rows) == ps.total and rows[0]["contributors"] == 4
    assert rows[-1]["contributors"] == 3 and "worker:1" not in rows[-1]["members"]
    assert all(o.get("stopped") for i, o in enumerate(outs) if i != 1)
    assert workload().evaluate(ps.params)["accuracy"] >= 0.5  # 3 epochs; chance is 0.1
    # written off once, by something that found its endpoint gone -- the probe after PROBE_AFTER_S of silence, or
    # whichever send or stream met the kill first (a round note, a control message on its way) -- never by the
    # silence rule: before the probe, a kill between messages waited out the whole silence
    drops = [e.reason for e in ps.membership.events_log if e.kind == "dropped"]
    assert len(drops) == 1 and not drops[0].startswith("silent"), drops


async def test_a_silent_worker_that_answers_its_probe_is_not_written_off(monkeypatch):
    """No heartbeats, and worker 1 computes one gradient for 3.5 s: silent past PROBE_AFTER_S (2 s), so the PS
    probes it; its endpoint answers, so it stays (the silence rule, SILENT_S, is the only other verdict), and
    every round has all four contributions."""
    from ltp_ps import hoplite_roles

    monkeypatch.setattr(hoplite_roles, "HEARTBEAT_S", 1000.0)
    ps, workers = make_job(4, epochs=1, lr=0.1)
    slow = workers[1]
    compute, slept = slow.workload.compute, []

    def slow_once(model, batch):
        if len(slept) == 0 and slow.iterations == 2:
            slept.append(1)
            time.sleep(3.5)  # in compute's thread: the worker's loop runs, its endpoint answers
        return compute(model, batch)
    slow.workload = _Wrapped(slow.workload, compute=slow_once)
    out = await asyncio.gather(ps.run(), *(w.run() for w in workers))
    assert slept and all(o.get("stopped") for o in out[1:])
    rows = [r for r in ps.metrics.rows if r["event"] == "iteration"]
    assert len(rows) == ps.total and all(r["contributors"] == 4 for r in rows)
    assert max(r["round_s"] for r in rows) >= 3.0  # the slow round did wait for it
    assert not [e for e in ps.membership.events_log if e.kind == "dropped"]
    assert out[2].get("probes", 0) >= 1, out[1:]  # worker 1 read the probe the PS sent it


class _Wrapped:
    """A workload with some attributes replaced."""

    def __init__(self, inner, **over):
        self._inner, self._over = inner, over

    def __getattr__(self, name):
        return self._over[name] if name in self._over else getattr(self._inner, name)


async def test_a_receiver_stops_waiting_for_a_relay_the_directory_gave_up_on(monkeypatch):
    """Every worker's relaying hangs (alive, heartbeats flowing, no chunk ever forwarded): the directory suspects a
    stalled relay after its stall timeout and sends the receiver to another source.  The receiver must drop the
    stalled fetch at once -- before, the new fetch queued behind it until its 20 s receive timeout, every round."""
    from ltp_ps import hoplite_roles

    monkeypatch.setattr(hoplite_roles, "PROCESS_STALL_TIMEOUT_S", 0.5)
    ps, workers = make_job(4, iterations=4, lr=0.1, join_timeout_s=60.0)
    for w in workers:
        w.cfg.pull_timeout_s = 20.0
        w.executor.payload_timeouts["params"] = 20.0
        run = w.executor.run

        async def hang_forwards(prog, *a, _run=run, **k):
            if any(st.op == "forward" for st in prog.steps()):
                await asyncio.sleep(3600)  # a relay that never forwards (cancelled with its round)
            return await _run(prog, *a, **k)

        w.executor.run = hang_forwards
    t0 = asyncio.get_running_loop().time()
    out = await asyncio.wait_for(asyncio.gather(ps.run(), *(w.run() for w in workers)), 60)
    took = asyncio.get_running_loop().time() - t0
    rows = [r for r in ps.metrics.rows if r["event"] == "iteration"]
    assert len(rows) == 4 and all(r["contributors"] == 4 for r in rows), rows
    assert sum(o.get("superseded", 0) for o in out[1:]) >= 1, out[1:]
    assert took < 15, took  # 4 rounds of about 1.5 s (a stall bound per relay tried); before: >= 20 s a round


async def test_transfers_failing_over_and_over_fail_the_job_at_the_stall_bound_instead_of_hanging():
    """Worker 2 is alive (heartbeats) but every parameter fetch of its comes back empty at once: the directory
    re-issues the fetch, which fails again, forever.  A failed transfer is no progress, so the round meets its
    stall bound (--join-timeout) and the job fails naming it; before, each failure counted as progress and the
    PS waited forever."""
    from types import SimpleNamespace

    from ltp_ps.errors import TrainingFailed

    ps, workers = make_job(3, iterations=3, lr=0.1, join_timeout_s=2.0)
    w2, run = workers[2], workers[2].executor.run
    fetches = []

    async def empty_fetches(prog, *a, **k):
        steps = prog.steps()
        if steps and all(st.op == "recv" and st.payload == "params" for st in steps):
            fetches.append(len(steps))
            await asyncio.sleep(0.01)
            return SimpleNamespace(reports=[None] * len(steps))
        return await run(prog, *a, **k)

    w2.executor.run = empty_fetches
    tasks = [asyncio.ensure_future(w.run()) for w in workers]
    with pytest.raises(TrainingFailed, match="made no progress for 2 s"):
        await asyncio.wait_for(ps.run(), 30)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert len(fetches) > 10  # it was a livelock: fetch after failed fetch


async def test_hoplite_reduce_in_rank_order_is_bitwise_direct(monkeypatch, piece_bytes):
    """Issue 11's accuracy gap (hoplite 0.9583 vs direct 0.9500 at 5 workers) is float summation order: with the
    chain in rank order (1D, rank r ready r x 0.25 s late) Hoplite's parameters after 4 rounds are bitwise those
    of direct, whose PS sums in rank order; Hoplite's default order gives float-rounding differences only."""
    from ltp_ps.hoplite_roles import READY_STAGGER_ENV

    async def train(schedule, stagger):
        monkeypatch.setenv(READY_STAGGER_ENV, str(stagger))
        ps, workers = make_job(4, iterations=4, lr=0.1, schedule=schedule)
        for p in [ps.planner] + [w.planner for w in workers]:
            p._link = lambda: (1e9, 1e-9)  # n B L << S: one 1D chain
        await asyncio.gather(ps.run(), *(w.run() for w in workers))
        return ps.params.copy()

    direct = await train("direct", 0)
    ranked = await train("hoplite", 0.25)
    assert np.array_equal(ranked, direct)
    assert np.abs(direct).max() > 0


def _recording(wl, w, seen):
    """The job's workload, recording each worker's gradient by the parameters it was computed on."""
    def compute(model, batch):
        g, loss, n = wl.compute(model, batch)
        seen[(w.node, hash(w.flat.tobytes()))] = np.asarray(g, np.float32).copy()
        return g, loss, n
    return _Wrapped(wl, compute=compute)


@pytest.mark.parametrize("n_workers", [3, 4])
async def test_hoplite_async_half_batch_applies_the_exact_mean_and_trains(n_workers):
    """--mode async: each update applies the mean of the first ceil(n/2) ready workers' gradients, computed on
    the versions the PS broadcast (checked exactly, update by update), and digits train."""
    ps, workers = make_job(n_workers, epochs=6, lr=0.4, momentum=0.0, mode="async")
    seen, versions, applied = {}, {0: hash(ps.params.tobytes())}, []
    for w in workers:
        w.workload = _recording(w.workload, w, seen)
    step = ps.optimizer.step

    def record(grad, mask=None):
        applied.append(grad.copy())
        return step(grad, mask=mask)
    ps.optimizer.step = record
    write = ps.metrics.write

    def on_row(row):
        if row.get("event") == "iteration":
            versions[row["iteration"] + 1] = hash(ps.params.tobytes())
        return write(row)
    ps.metrics.write = on_row
    out = await asyncio.gather(ps.run(), *(w.run() for w in workers))
    assert all(o.get("stopped") for o in out[1:])
    rows = [r for r in ps.metrics.rows if r["event"] == "iteration"]
    m = -(-n_workers // 2)
    assert len(rows) == -(-ps.total * n_workers // m) == len(applied)
    for r, g in zip(rows, applied):
        u = r["iteration"]
        assert r["mode"] == "async" and r["contributors"] == len(r["members"]) >= m
        assert all(0 <= s <= 2 for s in r["staleness"].values())
        grads = [seen[(w, versions[u - r["staleness"][w]])] for w in r["members"]]
        np.testing.assert_allclose(g, r["clip_scale"] * np.mean(grads, axis=0), rtol=1e-5, atol=1e-7)
    assert ps.staleness.max <= 2 and ps.staleness.mean > 0
    # chance is 0.1. The last iterate of async SGD at lr 0.4 depends on which workers the loop happened to
    # find ready: 0.81-0.94 in 10 runs (2026-11-28), and 0.633 in 2 of 38 runs on a loaded machine, so the bar
    # is set where a run that trained clears it every time and one that did not (0.1-0.3) never does.
    assert workload().evaluate(ps.params)["accuracy"] >= 0.5


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = ("--model", "digits", "--seed", 0)  # default optimizer (sgd, lr and momentum), as in the direct comparison


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", "ltp"])
def test_launch_hoplite_trains_digits(tmp_path, transport):
    summary, metrics = tmp_path / "s.json", tmp_path / "m.jsonl"
    p = subprocess.run(ps_cmd("launch", "--schedule", "hoplite", "--workers", 3, "--epochs", 8, "--lab", "off",
                              "--transport", transport, "--summary-json", summary, "--metrics", metrics, *TRAIN),
                       env=child_env(), capture_output=True, text=True, timeout=110)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "hoplite: receiver-driven broadcast and reduce chains" in p.stdout
    s = json.loads(summary.read_text())
    its = [r for r in map(json.loads, open(metrics)) if r.get("event") == "iteration"]
    assert its and all(r["schedule"] == "hoplite" and r["contributors"] == 3 for r in its)
    assert s["final_accuracy"] >= 0.9, s  # direct over TCP: 0.978 at these settings (docs/schedules.md)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", "ltp"])
def test_launch_hoplite_async_half_batch_trains_digits(tmp_path, transport):
    summary, metrics = tmp_path / "s.json", tmp_path / "m.jsonl"
    p = subprocess.run(ps_cmd("launch", "--schedule", "hoplite", "--mode", "async", "--workers", 4, "--epochs", 12,
                              "--lab", "off", "--transport", transport, "--summary-json", summary, "--metrics",
                              metrics, "--model", "digits", "--seed", 0, "--momentum", 0, "--lr", 0.4),
                       env=child_env(), capture_output=True, text=True, timeout=110)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "hoplite async: half-batch updates of 2 of 4 workers' gradients" in p.stdout
    s = json.loads(summary.read_text())
    its = [r for r in map(json.loads, open(metrics)) if r.get("event") == "iteration"]
    assert len(its) == 288 and all(r["mode"] == "async" and r["contributors"] >= 2 for r in its)
    assert max(max(r["staleness"].values()) for r in its) <= 2
    # asynchronous updates have no batch synchronisation: nothing made up (it read "sync 0.00 ms" before)
    assert all(r["gather_s"] is None and r["broadcast_s"] is None for r in its)
    assert s["sync_mean_s"] is None and "batch sync mean       - ms" in p.stdout, p.stdout[-2000:]
    assert all(" sync       - ms " in ln for ln in p.stdout.splitlines() if "] epoch " in ln), p.stdout[-2000:]
    acc = [r["accuracy"] for r in map(json.loads, open(metrics)) if r.get("event") == "epoch"
           and r.get("accuracy") is not None]
    # asynchronous updates are noisy from epoch to epoch and the first epochs are slow (two CI runs under load
    # ended 8 epochs at 0.81 and 0.71/0.85/0.96); 12 epochs under a busy core measured last three 0.95-0.98, so
    # the last three epochs are judged together
    assert len(acc) == 12 and s["best_accuracy"] >= 0.9, (acc, s)
    assert sum(acc[-3:]) / 3 >= 0.85, (acc, s)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_torchrun_hoplite_trains_digits():
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                        "--master-port", str(free_port()), "-m", "ltp_ps.run", "--schedule", "hoplite",
                        "--epochs", "8", "--transport", "tcp", *map(str, TRAIN)],
                       env=child_env(), capture_output=True, text=True, timeout=110, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    acc = [float(a) for a in re.findall(r"acc (\d\.\d+)", p.stdout)]
    assert len(acc) == 8 and acc[-1] >= 0.9, p.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("model,transport,run", [("digits", "tcp", ("--epochs", 6)),
                                                 # 150 rounds: about 0.1 s each here after the kill, 0.2-0.25 s on a
                                                 # slow CI machine (400 rounds there outlasted the 100 s wait)
                                                 ("synthetic:600000", "ltp", ("--iterations", 150))],
                         ids=["digits-whole", "2.4MB-pieces"])
def test_launch_hoplite_killed_worker_does_not_hang(tmp_path, model, transport, run):
    """Real processes: SIGKILL a worker mid-run; later rounds close with the other two.  The 2.4 MB model is
    reduced in 5 pieces (cut-through hops) and broadcast through cut-through relays."""
    metrics = tmp_path / "m.jsonl"
    text = launch_and_kill(("--schedule", "hoplite", "--workers", 3, *run, "--lab", "off", "--transport", transport,
                            "--compute-delay", 0.01, "--model", model, "--seed", 0), tmp_path / "launch.out", metrics,
                           rank=2, after_rows=10, start_s=90, end_s=100)
    assert "final / best accuracy" in text  # the PS finished with the two others
    its = [r for r in map(json.loads, open(metrics)) if r.get("event") == "iteration"]
    assert its[0]["contributors"] == 3 and its[-1]["contributors"] == 2
    delivered = [r["delivered"]["all"] for r in its]
    worst = sorted((r["delivered"]["all"], r["iteration"], r["contributors"], round(r["gather_s"], 3)) for r in its)[:5]
    # no piece lost an input to the dead worker: its predecessor re-sent every running sum it held
    assert sum(r["short_pieces"] for r in its) == 0, [r for r in its if r["short_pieces"]][:3]
    if transport == "tcp":
        assert min(delivered) == 1.0, worst  # every element of every round reduced from someone
    else:
        # LTP's loss-tolerant hops close at their hard deadline with what arrived, so rounds whose senders were
        # starved of CPU lose part of a piece: measured with 10 busy loops beside the job, 7-8 rounds of ~200 at
        # 0.79-0.96 (gather 2-5x its median), the mean 0.994-0.995; a CI run on a degraded machine saw two at 0.71
        # and 0.78.  Per-element loss, not a lost input (short_pieces above); most of every round still arrives.
        assert min(delivered) > 0.5 and sum(delivered) / len(delivered) > 0.99, worst


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("schedule", ["hoplite", "mlfabric"])
def test_a_controller_job_starts_with_min_workers_while_one_worker_never_comes(schedule):
    """``--min-workers 3`` of 4, the fourth never started (processes by hand): the PS grants transfers only among
    the three that joined, so they must not wait for the absent one's address.  They did: every worker sat in
    the look-up until --store-timeout while the PS wrote all three off as silent."""
    from ps_helpers import JobByHand

    with JobByHand("--workers", 4, "--model", "digits", "--transport", "ltp", "--store-timeout", 60,
                   "--schedule", schedule) as job:
        server = job.server("--iterations", 20, "--min-workers", 3)
        workers = [job.worker(r) for r in range(3)]
        out, _ = server.communicate(timeout=100)
        assert server.returncode == 0, out
        assert "final / best accuracy" in out and "dropped worker" not in out, out
        for w in workers:
            w_out, _ = w.communicate(timeout=30)
            assert w.returncode == 0, w_out


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_restarted_hoplite_worker_process_is_reached_at_its_new_address(tmp_path):
    """Worker 2's process killed mid-run and started anew (new port; processes by hand): the PS takes it back and
    tells the others; they must look its address up again.  Before, they kept sending relays and reduce hops to
    the dead process's port, every transfer failed, and the round never ended -- a failed transfer counted as
    progress, so the PS's --join-timeout bound never fired either (both fixed)."""
    from ps_helpers import JobByHand

    metrics = tmp_path / "m.jsonl"
    with JobByHand("--workers", 3, "--model", "digits", "--transport", "ltp", "--store-timeout", 30,
                   "--schedule", "hoplite") as job:
        server = job.server("--iterations", 150, "--metrics", metrics)
        workers = [job.worker(r, quiet=True) for r in range(3)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (
                metrics.exists() and sum('"event": "iteration"' in x for x in open(metrics)) >= 20):
            time.sleep(0.05)
        workers[2].kill()
        workers[2].wait()
        job.worker(2, quiet=True)
        out, _ = server.communicate(timeout=110)
        assert server.returncode == 0, out
        assert "worker 2 joined again" in out, out
        its = [r for r in map(json.loads, open(metrics)) if r.get("event") == "iteration"]
        assert len(its) == 150 and its[-1]["contributors"] == 3 and "worker:2" in its[-1]["members"], its[-1]


def test_hoplite_cli_accepts_one_shard_bsp_or_async_and_names_the_fix_otherwise():
    import argparse

    from ltp_ps import schedule_cli
    from ltp_ps.errors import ConfigError

    ok = argparse.Namespace(schedule="hoplite", mode="bsp", num_servers=1, workers=3)
    schedule_cli.check_server_schedule(ok)
    with pytest.raises(ConfigError, match="--num-servers 1"):
        schedule_cli.check_server_schedule(argparse.Namespace(**{**vars(ok), "num_servers": 2}))
    schedule_cli.check_server_schedule(argparse.Namespace(**{**vars(ok), "mode": "async"}))  # half-batch updates
    with pytest.raises(ConfigError, match="--num-servers 1"):
        schedule_cli.check_server_schedule(argparse.Namespace(**{**vars(ok), "mode": "async", "num_servers": 3}))


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", "ltp"])
def test_launch_hoplite_kill_worker_drill_drops_the_worker(tmp_path, transport):
    """``--kill-worker-after 5``: worker 0 leaves once its 5th gradient went up (it was ignored: the Hoplite
    worker never looked at --max-iterations); the PS drops it and the others finish the run.  Over LTP nothing
    is in flight to it when it exits: the PS's probe after PROBE_AFTER_S of silence finds its port closed (ICMP
    unreachable) and drops it then; before the probe, the round waited out SILENT_S (10 s)."""
    from ltp_ps.hoplite_roles import PROBE_AFTER_S, SILENT_S

    metrics = tmp_path / "m.jsonl"
    p = subprocess.run(ps_cmd("launch", "--schedule", "hoplite", "--workers", 3, "--epochs", 2, "--lab", "off",
                              "--transport", transport, "--kill-worker-after", 5, "--metrics", metrics, "--model",
                              "digits", "--seed", 0), env=child_env(), capture_output=True, text=True, timeout=110)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "dropped worker 0" in p.stdout, p.stdout[-3000:]
    its = [r for r in map(json.loads, open(metrics)) if r.get("event") == "iteration"]
    assert [r["contributors"] for r in its[:5]] == [3] * 5 and its[-1]["contributors"] == 2
    assert all("worker:0" not in r["members"] for r in its[6:])
    if transport == "ltp":
        assert "dropped worker 0: gone: a probe after" in p.stdout, p.stdout[-3000:]
        assert its[5]["round_s"] < (PROBE_AFTER_S + SILENT_S) / 2, its[5]
