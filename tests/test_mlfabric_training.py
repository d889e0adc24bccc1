"""MLfabric trains digits end to end: the PS hosts the controller, workers follow its grants (in memory)."""

from __future__ import annotations

import asyncio
import random

import pytest

from ltp_ps.schedules import World, create
from ltp_ps.schedules.program import server, worker
from ltp_ps.server import ParameterServer, ServerConfig
from ltp_ps.sharding import ShardPlan
from ltp_ps.transport import MemoryNetwork
from ltp_ps.worker import ShardRef, Worker, WorkerConfig
from ps_helpers import workload

pytestmark = pytest.mark.timeout(240)


def make_mlf_job(n_workers, *, loss=0.0, seed=0, topology=None, tau_max=8, k=1, worker_kw=None, wl=None, jitter_s=0.0,
                 **server_kw):
    wl = wl or workload()
    net = MemoryNetwork(loss=loss, segment_size=1024, seed=seed, jitter_s=jitter_s)
    plan = ShardPlan(wl.n_params, 1)
    world = World(workers=range(n_workers), n_elems=wl.n_params, shards=tuple(plan.ranges), topology=topology,
                  layout=tuple(wl.layout()))
    s_ep = net.endpoint()
    w_eps = [net.endpoint() for _ in range(n_workers)]
    addrs = {server(0): s_ep.local_addr, **{worker(r): e.local_addr for r, e in enumerate(w_eps)}}

    def planner():
        return create("mlfabric", world, rng=random.Random(seed), tau_max=tau_max, k=k)

    ps = ParameterServer(wl, s_ep, ServerConfig(world_size=n_workers, **server_kw), plan=plan, shard=0,
                         log=lambda _: None, planner=planner())
    ref = ShardRef(0, s_ep.local_addr, ps.lo, ps.hi)
    workers = []
    for r in range(n_workers):
        ps.admit(r, w_eps[r].local_addr)
        w = Worker(wl, w_eps[r], [ref], WorkerConfig(rank=r, world_size=n_workers, **(worker_kw or {})),
                   planner=planner())
        w.executor.addresses.update(addrs)
        workers.append(w)
    return ps, workers


@pytest.mark.parametrize("n_workers,k,loss,epochs,want", [(3, 1, 0.0, 8, 0.8), (5, 2, 0.0, 12, 0.75),
                                                          (4, 1, 0.03, 16, 0.75)])
async def test_mlfabric_trains_digits(n_workers, k, loss, epochs, want):
    ps, workers = make_mlf_job(n_workers, k=k, loss=loss, seed=n_workers, epochs=epochs, lr=0.1, momentum=0.0)
    summary, *outs = await asyncio.gather(ps.run(), *(w.run() for w in workers))
    assert all(o["stopped"] for o in outs)
    st = ps.mlfabric_stats
    assert st["beyond_tau"] == 0, st
    assert ps.version >= ps.total * n_workers
    rows = [r for r in ps.metrics.rows if r["event"] == "iteration"]
    assert sum(r["contributors"] for r in rows) == ps.version
    assert max(r["staleness"] for r in rows) <= st["tau_max"] - 1  # eq 9 as written keeps one version in hand
    acc = workload().evaluate(ps.params)["accuracy"]
    assert summary["best_accuracy"] >= want, (acc, summary, st)  # async SGD: order varies run to run
    print(n_workers, k, loss, "acc", acc, st)


async def test_tight_tau_max_is_never_exceeded_live():
    """6 workers, tau_max = 2: the live PS counts every applied gradient's staleness; none may exceed the bound."""
    ps, workers = make_mlf_job(6, k=1, tau_max=2, seed=6, epochs=2, lr=0.1, momentum=0.0)
    summary, *outs = await asyncio.gather(ps.run(), *(w.run() for w in workers))
    st = ps.mlfabric_stats
    rows = [r for r in ps.metrics.rows if r["event"] == "iteration"]
    assert rows and st["beyond_tau"] == 0
    assert max(s for r in rows for s in r["staleness_all"]) <= 1  # eq 9 as written: tau_max - 1
    assert st["dropped"] == sum(o["dropped"] for o in outs)  # every drop the planner made reached its worker
    assert ps.version >= ps.total * 6
    print("tau_max=2", st, "staleness max", summary["staleness_max"])


async def test_killed_worker_does_not_hang_the_job():
    ps, workers = make_mlf_job(4, k=1, seed=4, epochs=4, lr=0.1, momentum=0.0, join_timeout_s=20)
    victim = workers[1]
    victim.cfg.max_iterations = 5
    net = victim.transport.net

    async def kill():
        while victim.iterations < 5:
            await asyncio.sleep(0.01)
        net.kill(victim.transport.local_addr)  # the process is gone

    t0 = asyncio.get_running_loop().time()
    summary, *outs = await asyncio.wait_for(asyncio.gather(ps.run(), *(w.run() for w in workers), kill()), 200)
    st = ps.mlfabric_stats
    assert st["failed_workers"] == [worker(1)], st
    assert ps.version >= ps.total * 4  # the others finished the job
    assert outs[1]["stopped"] is False and all(o["stopped"] for i, o in enumerate(outs[:4]) if i != 1)
    assert st["beyond_tau"] == 0
    print("killed worker: finished in", asyncio.get_running_loop().time() - t0, "s", st)


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


# jitter: sends overlap and end out of order, as under CI's load, so the PS's failure finds grants on their way (the
# driver cancels them; a control message that took its number and was never sent hid the STOP: a 60 s hang)
@pytest.mark.parametrize("jitter_s,seed", [(0.0, 1)] + [(j, s) for j in (0.002, 0.01, 0.03) for s in range(1, 9)])
async def test_non_finite_loss_fails_the_job_and_stops_every_worker(jitter_s, seed):
    from ltp_ps.errors import TrainingFailed

    ps, workers = make_mlf_job(3, wl=_NanAfter(workload(), 12), seed=seed, epochs=20, lr=0.1, momentum=0.0,
                               jitter_s=jitter_s)
    res = await asyncio.wait_for(asyncio.gather(ps.run(), *(w.run() for w in workers), return_exceptions=True), 30)
    assert isinstance(res[0], TrainingFailed) and "non-finite loss" in str(res[0])
    assert all(isinstance(r, dict) and r["stopped"] for r in res[1:])  # told to stop, none waits out a timeout
    assert ps.version < ps.total * 3


# -- end to end over processes ----------------------------------------------------------------------------------------

import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from ps_helpers import child_env, free_port, launch_and_kill, ps_cmd  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = ("--model", "digits", "--lr", 0.1, "--momentum", 0)
# Updates of one batch are computed on one version and applied in a row: n of them act like one step of n x lr,
# so 6 workers need a smaller lr (0.1 diverged to 0.1-0.46 accuracy over TCP; see docs/schedules.md).
LR_FOR = {3: 0.1, 4: 0.1, 6: 0.05}
WANT_FOR = {3: 0.8, 4: 0.8, 6: 0.7}  # best accuracy; 6 workers at lr 0.05 measured 0.772 over TCP


def _beyond_tau(metrics) -> tuple:
    rows = [json.loads(x) for x in open(metrics) if x.strip()]
    its = [r for r in rows if r.get("event") == "iteration"]
    return its, sum(1 for r in its for s in r["staleness_all"] if s > 8 - 1)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport,workers", [("tcp", 3), ("ltp", 4), ("tcp", 6)])
def test_launch_mlfabric_trains_digits(tmp_path, transport, workers):
    summary, metrics = tmp_path / "s.json", tmp_path / "m.jsonl"
    p = subprocess.run(ps_cmd("launch", "--schedule", "mlfabric", "--workers", workers, "--epochs", 10, "--lab", "off",
                              "--transport", transport, "--summary-json", summary, "--metrics", metrics, *TRAIN,
                              "--lr", LR_FOR[workers]),
                       env=child_env(), capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "asynchronous updates through the controller" in p.stdout
    s = json.loads(summary.read_text())
    its, beyond = _beyond_tau(metrics)
    assert beyond == 0 and sum(r["contributors"] for r in its) >= 10 * workers
    assert s["best_accuracy"] >= WANT_FOR[workers], s  # async SGD on 10 small epochs; order varies run to run
    print(transport, workers, "acc", s["final_accuracy"], s["best_accuracy"], "wall", s["wall_s"],
          "staleness max", s["staleness_max"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_launch_mlfabric_killed_worker_does_not_hang(tmp_path):
    metrics = tmp_path / "m.jsonl"
    text = launch_and_kill(("--schedule", "mlfabric", "--workers", 4, "--epochs", 6, "--lab", "off", "--transport",
                            "tcp", "--compute-delay", 0.01, *TRAIN), tmp_path / "launch.out", metrics, rank=2,
                           after_rows=20, start_s=150, end_s=200)
    assert "final / best accuracy" in text  # the PS finished with the three others
    _, beyond = _beyond_tau(metrics)
    assert beyond == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_mlfabric_trains_digits():
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                        "--master-port", str(free_port()), "-m", "ltp_ps.run", "--schedule", "mlfabric",
                        "--epochs", "10", "--transport", "tcp", *map(str, TRAIN)],
                       env=child_env(), capture_output=True, text=True, timeout=280, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "asynchronous updates through the controller" in p.stdout
    acc = [float(a) for a in re.findall(r"acc (\d\.\d+)", p.stdout)]
    assert len(acc) == 10 and max(acc) >= 0.8, p.stdout[-2000:]
    print("torchrun acc", acc)


async def test_next_gradient_sees_the_workers_own_applied_update():
    """Paper §3 async SGD (push, then pull the latest model): a worker's parameters come after its update's Apply.

    Per worker, every applied update j + 1 was computed on a version at least the PS version right after update
    j was applied.  Sent at grant time instead (the first version), update j + 1 missed update j: this fails.
    """
    ps, workers = make_mlf_job(4, k=1, seed=3, epochs=1, lr=0.05, momentum=0.0)
    summary, *outs = await asyncio.gather(ps.run(), *(w.run() for w in workers))
    rows = [r for r in ps.metrics.rows if r["event"] == "iteration"]
    seen: dict = {}  # worker -> [(computed on, PS version after its apply)]
    for r in rows:
        for m, s in zip(r["members"], r["staleness_all"]):
            seen.setdefault(m, []).append((r["iteration"] - s, r["version"]))
    assert len(seen) == 4 and all(len(v) >= 5 for v in seen.values()), seen
    for m, v in seen.items():
        for (_, after), (computed_next, _) in zip(v, v[1:]):
            assert computed_next >= after, (m, v)
    assert ps.mlfabric_stats["beyond_tau"] == 0


def test_a_commit_applied_after_the_last_gradient_is_not_trained_on_nor_a_new_epoch():
    """Commits still in flight when the run's last gradient was applied (a burst after a stall of the PS) are
    dropped and counted (``after_end``).  Before, each one stepped the model again and ended the last epoch once
    more: a PS paused for 10 s printed "epoch 6/6" twice."""
    import types

    import numpy as np

    from ltp_ps.dynamic_roles import _ServerRole
    from ltp_ps.schedules.executor import Slots
    from ltp_ps.schedules.partial import Partial

    ps, _ = make_mlf_job(3, epochs=2, lr=0.1, momentum=0.0)
    role = _ServerRole(ps)
    slots = Slots()
    step = types.SimpleNamespace(slot="mlf:0:0:0", lo=0, hi=ps.n)

    def commit(version):
        slots.put_partial(step.slot, Partial.of_gradient(np.ones(ps.n, np.float32), samples=32, loss=1.0))
        role.versions[step.slot] = (["worker:0"], [version])
        return role.apply(step, slots)

    ps.version = role.total - 1
    commit(ps.version)
    assert ps.version == role.total and len([r for r in ps.metrics.rows if r["event"] == "epoch"]) == 1
    before = ps.params.copy()
    commit(ps.version)
    assert ps.version == role.total and np.array_equal(ps.params, before)
    assert len([r for r in ps.metrics.rows if r["event"] == "epoch"]) == 1
    assert role.counters["after_end"] == 1
