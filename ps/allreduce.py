"""Workers that reduce among themselves and each apply the optimizer (ring-family schedules, no PS).

Theory of operation
-------------------
For schedules with ``apply_at == "workers"`` (``ring``, RSGCM rings) there is
no PS process.  Every worker holds the whole model and an identical optimizer
(same initial parameters from the same seed), and runs, each round ``i``::

    plan(i)        the schedule's program for this worker (every worker derives
                   the same plan from the same world; rank 0 published it)
    Compute        gradient at the current parameters -> partial in slot "acc"
    transfers      the schedule's reduce steps (executor; partial aggregates, so
                   losses on tolerant hops only remove contributions)
    Adopt          every chunk's unbiased mean -> the reduced gradient
    Apply          optimizer step on the reduced gradient (every worker, same bits:
                   the all-gather is reliable)

Rank 0 evaluates at the end of every epoch and writes the metrics rows the PS
writes in direct mode, so summaries compare like with like.  A chunk that
never arrives in a reliable step (a dead neighbour) breaks the round for
everyone: that raises :class:`~ltp_ps.errors.TrainingFailed` (rings have no
spare path; RSGCM replans around failures instead).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Callable

import numpy as np

from .errors import TrainingFailed
from .metrics import MetricsLog, summarize
from .optim import FlatOptimizer
from .schedules.executor import Executor, Slots
from .schedules.partial import Partial
from .schedules.program import worker as worker_node
from .workloads import Workload, set_flat


@dataclasses.dataclass
class PeerConfig:
    rank: int
    world_size: int
    epochs: int = 1
    iterations: int | None = None  # overrides epochs * iters_per_epoch
    aggregation: str = "unbiased"
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    step_timeout_s: float = 60.0  # seconds a reduce step waits for its neighbour (compute skew included)
    seed: int = 0
    metrics_path: str | None = None
    evaluate: bool = True  # rank 0 evaluates at every epoch end
    max_iterations: int | None = None  # stop after this many rounds (failure drills)


class PeerWorker:
    """One worker of a PS-less schedule: compute, reduce with peers through the executor, apply."""

    def __init__(self, workload: Workload, transport, config: PeerConfig, *, planner, addresses: dict,
                 log: Callable[[str], None] | None = None):
        self.workload = workload
        self.transport = transport
        self.cfg = config
        self.planner = planner
        self.log = log or (lambda s: print(s, flush=True))
        self.node = worker_node(config.rank)
        self.n = workload.n_params
        self.model = workload.build_model()
        self.params = workload.initial_params(config.seed).astype(np.float32).copy()
        self.optimizer = FlatOptimizer(self.params, config.optimizer, lr=config.lr, momentum=config.momentum,
                                       weight_decay=config.weight_decay)
        self.mean = np.zeros(self.n, dtype=np.float32)
        self.executor = Executor(transport, self.node, addresses, timeout_s=config.step_timeout_s)
        self.slots = Slots()
        self.ipe = max(1, workload.iters_per_epoch(config.world_size))
        self.total = config.iterations if config.iterations is not None else config.epochs * self.ipe
        self.epochs_total = -(-self.total // self.ipe)
        self.iteration = 0
        self.metrics = MetricsLog(config.metrics_path if config.rank == 0 else None)
        self.epoch_lines: list[str] = []
        self._batches = None
        self._round: dict = {}

    # -- handlers the executor calls ---------------------------------------------------------------------
    async def compute(self, step, slots: Slots):
        if self.model is not None:
            set_flat(self.model, self.params)
        batch = next(self._batches)
        t0 = time.monotonic()
        grad, loss, samples = await asyncio.to_thread(self.workload.compute, self.model, batch)
        self._round.update(compute_s=time.monotonic() - t0, own_loss=float(loss))
        if not np.isfinite(loss):
            raise TrainingFailed(f"worker {self.cfg.rank}: non-finite loss ({loss}) at round {self.iteration}; "
                                 f"training diverged: lower --lr")
        slots.clear_partials()
        slots.put_partial(step.slot, Partial.of_gradient(np.asarray(grad, np.float32), samples=samples, loss=loss))
        self._round["t_reduce0"] = time.monotonic()
        return None

    def adopt(self, step, slots: Slots):
        p = slots.partial(step.slot, step.lo, step.hi)
        if p is None:
            raise TrainingFailed(f"worker {self.cfg.rank}: round {self.iteration}: the reduced chunk "
                                 f"[{step.lo}, {step.hi}) never arrived (a ring neighbour died or stalled "
                                 f"beyond {self.cfg.step_timeout_s:.0f} s); rings have no spare path")
        p.mean(self.cfg.aggregation, out=self.mean[step.lo:step.hi])
        c = p.counts()
        st = self._round
        st["delivered"] = st.get("delivered", 0) + int(c.sum())
        st["contributors"] = max(st.get("contributors", 0), p.contributors)
        if step.lo == 0:
            st["loss"] = p.loss_sum / max(1, p.contributors)
            st["samples"] = p.samples
        return None

    def apply(self, step, slots: Slots):
        if not np.isfinite(self.mean).all():
            raise TrainingFailed(f"worker {self.cfg.rank}: round {self.iteration}: non-finite reduced gradient")
        self.optimizer.step(self.mean)
        return None

    # -- loop --------------------------------------------------------------------------------------------------
    async def run(self) -> dict:
        """Train ``total`` rounds; returns the summary (rank 0's rows)."""
        if self._batches is None:
            self._batches = self.workload.batches(self.cfg.rank, self.cfg.world_size, self.cfg.seed)
        epoch_rows: list = []
        try:
            while self.iteration < self.total:
                row = await self.round()
                epoch_rows.append(row)
                if self.iteration % self.ipe == 0 or self.iteration == self.total:
                    self._end_epoch(epoch_rows)
                    epoch_rows = []
                if self.cfg.max_iterations is not None and self.iteration >= self.cfg.max_iterations:
                    break
        finally:
            self.metrics.close()
        s = summarize(self.metrics.rows)
        s["stopped"] = self.iteration >= self.total
        s["iterations_run"] = self.iteration
        return s

    async def round(self) -> dict:
        it = self.iteration
        self._round = {}
        plan = self.planner.plan(it)
        t0 = time.monotonic()
        res = await self.executor.run(plan.program(self.node), self.slots, self, iteration=it)
        if res.stopped:
            raise TrainingFailed(f"worker {self.cfg.rank}: round {it} stopped early")
        wall = time.monotonic() - t0
        st = self._round
        reduce_s = time.monotonic() - st.get("t_reduce0", t0)
        if not np.isfinite(self.params).all():
            raise TrainingFailed(f"worker {self.cfg.rank}: parameters became non-finite at round {it}; lower --lr")
        self.iteration += 1
        n = max(1, self.n)
        frac = st.get("delivered", 0) / (n * max(1, self.cfg.world_size))
        row = {"event": "iteration", "t": time.time(), "rank": self.cfg.rank, "iteration": it,
               "epoch": it // self.ipe, "workers": self.cfg.world_size, "contributors": st.get("contributors", 0),
               "gather_s": reduce_s, "broadcast_s": 0.0, "round_s": wall, "compute_max_s": st.get("compute_s", 0.0),
               "delivered": {str(self.cfg.rank): frac}, "missing_steps": len(res.missing),
               "loss": st.get("loss", float("nan")), "samples": st.get("samples", 0)}
        self.metrics.write(row)
        return row

    def _end_epoch(self, rows: list) -> None:
        if self.cfg.rank != 0:
            return
        epoch = (self.iteration - 1) // self.ipe
        ev = self.workload.evaluate(self.params) if self.cfg.evaluate else {}
        sync = [r["gather_s"] for r in rows] or [float("nan")]
        loss = [r["loss"] for r in rows if r["loss"] == r["loss"]] or [float("nan")]
        fr = [f for r in rows for f in r["delivered"].values()] or [float("nan")]
        row = {"event": "epoch", "t": time.time(), "epoch": epoch, "iteration": self.iteration,
               "loss": float(np.mean(loss)), "sync_mean_s": float(np.mean(sync)), "delivered_mean": float(np.mean(fr)),
               "workers": self.cfg.world_size, **ev}
        self.metrics.write(row)
        acc = f"acc {ev['accuracy']:.4f}  " if "accuracy" in ev else ""
        line = (f"[{self.planner.name} w0] epoch {epoch + 1:>3}/{self.epochs_total}  {acc}loss {row['loss']:.4f}  "
                f"reduce {row['sync_mean_s'] * 1e3:7.2f} ms  delivered {row['delivered_mean']:.4f}")
        self.epoch_lines.append(line)
        self.log(line)

