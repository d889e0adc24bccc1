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

With a ``feedback`` channel (:mod:`ltp_ps.plan_feedback`, given for adaptive
planners such as RSGCM) every attempt of a round ends with one exchange
through the coordinator; the optimizer step waits for its verdict.  A missing
chunk then does not fail the job: the coordinator's decision (failed pairs,
the round's time) goes to every worker's planner, and the round's reduce is
run again on the gradient already computed, with the new plan (attempt
numbers ``seq`` keep tags of the failed attempt apart).  No round is lost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Callable

import numpy as np

from .errors import TrainingFailed
from .metrics import MetricsLog, epoch_loss, figure, summarize
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
                 log: Callable[[str], None] | None = None, feedback=None):
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
        self.executor.skip_silent = True  # a dead ring neighbour fails the round after one step timeout
        self.slots = Slots()
        self.ipe = max(1, workload.iters_per_epoch(config.world_size))
        self.total = config.iterations if config.iterations is not None else config.epochs * self.ipe
        self.epochs_total = -(-self.total // self.ipe)
        self.iteration = 0
        self.metrics = MetricsLog(config.metrics_path if config.rank == 0 else None)
        self.epoch_lines: list[str] = []
        self._batches = None
        self._round: dict = {}
        self.feedback = feedback  # plan_feedback.MemoryFeedback / StoreFeedback, or None
        self.seq = 0  # reduce attempts so far (== iteration without feedback); the same on every worker
        self.retries = 0  # attempts that were run again after a failure (feedback only)
        self.plan_log: list = []  # (iteration, seq, plan source, ok) per attempt, feedback only
        self.rank_of = {worker_node(r): r for r in range(config.world_size)}
        self._grad = None  # this round's computed partial (kept for retries)

    # -- handlers the executor calls ---------------------------------------------------------------------
    async def compute(self, step, slots: Slots):
        if self._grad is not None:  # a retry: reduce the gradient this round already computed
            slots.clear_partials()
            slots.put_partial(step.slot, self._grad.copy())
            self._round["t_reduce0"] = time.monotonic()
            return None
        if self.model is not None:
            set_flat(self.model, self.params)
        batch = await asyncio.to_thread(next, self._batches)  # a batch can be seconds of work (synthetic 100+ MB)
        t0 = time.monotonic()
        grad, loss, samples = await asyncio.to_thread(self.workload.compute, self.model, batch)
        self._round.update(compute_s=time.monotonic() - t0, own_loss=float(loss))
        if not np.isfinite(loss):
            raise TrainingFailed(f"worker {self.cfg.rank}: non-finite loss ({loss}) at round {self.iteration}; "
                                 f"training diverged: lower --lr")
        slots.clear_partials()
        part = Partial.of_gradient(np.asarray(grad, np.float32), samples=samples, loss=loss)
        if self.feedback is not None:
            self._grad = part.copy()
        slots.put_partial(step.slot, part)
        self._round["t_reduce0"] = time.monotonic()
        return None

    def adopt(self, step, slots: Slots):
        p = slots.partial(step.slot, step.lo, step.hi)
        if p is None and self.feedback is not None:
            self._round["incomplete"] = True  # the coordinator decides (replan, retry)
            return None
        if p is None:
            why = self.executor.first_missing or "no receive of this round came back empty"
            raise TrainingFailed(f"worker {self.cfg.rank}: round {self.iteration}: the reduced chunk "
                                 f"[{step.lo}, {step.hi}) never arrived; the first input missing this round: "
                                 f"{why}. Rings have no spare path (a peer slower than the step timeout, "
                                 f"{self.cfg.step_timeout_s:g} s, needs a longer --pull-timeout)")
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
        if self.feedback is not None:
            self._round["apply_pending"] = True  # applied once the coordinator says the round is complete
            return None
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
        if self.feedback is not None:
            return await self._round_with_feedback(it)
        self._round = {}
        plan = self.planner.plan(it)
        t0 = time.monotonic()
        res = await self.executor.run(plan.program(self.node), self.slots, self, iteration=it)
        if res.stopped:
            raise TrainingFailed(f"worker {self.cfg.rank}: round {it} stopped early")
        wall = time.monotonic() - t0
        reduce_s = time.monotonic() - self._round.get("t_reduce0", t0)
        return self._finish_round(it, res, wall, reduce_s)

    async def _round_with_feedback(self, it: int) -> dict:
        from .plan_feedback import MAX_RETRIES, apply_decision, outcome_of

        t0 = time.monotonic()
        self._grad = None
        kept: dict = {}
        for attempt in range(MAX_RETRIES + 1):
            seq = self.seq
            self.seq += 1
            self._round = {k: v for k, v in kept.items()}
            plan = self.planner.plan(seq)
            program = plan.program(self.node)
            res = await self.executor.run(program, self.slots, self, iteration=seq)
            if res.stopped:
                raise TrainingFailed(f"worker {self.cfg.rank}: round {it} stopped early")
            st = self._round
            kept = {k: st[k] for k in ("compute_s", "own_loss") if k in st}
            reduce_s = time.monotonic() - st.get("t_reduce0", t0)
            # complete: every chunk adopted, applied, and no reliable receive missed (a missed all-gather
            # chunk leaves the local partial in its slot: adopting it would split the replicas)
            steps = program.steps()
            reliable_missed = any(steps[i].op == "recv" and getattr(steps[i], "mode", None) == "reliable"
                                  for i, _ in res.missing)
            ok = not st.get("incomplete") and bool(st.get("apply_pending")) and not reliable_missed
            outcome = outcome_of(self.cfg.rank, seq, program, res, ok=ok, reduce_s=reduce_s,
                                 rank_of=self.rank_of.get)
            decision = await self.feedback.exchange(outcome)
            if self.cfg.rank in decision.dead:
                raise TrainingFailed(f"worker {self.cfg.rank}: round {it}: the coordinator heard nothing from this "
                                     f"worker within its bound and replanned without it; restart the job")
            apply_decision(self.planner, decision)
            last = getattr(self.planner, "_last", None)
            rings = [list(r) for a in getattr(last, "steps", ()) for rs in a.ring_sets for r in rs.rings]
            self.plan_log.append({"iteration": it, "seq": seq, "source": getattr(last, "source", None),
                                  "ok": not decision.retry, "rings": rings,
                                  "failed_pairs": [list(p) for p in decision.failed_pairs], "reduce_s": reduce_s})
            if not decision.retry:
                self.optimizer.step(self.mean)
                self._grad = None
                row = self._finish_round(it, res, time.monotonic() - t0, reduce_s, write=False)
                row.update(attempts=attempt + 1, plan=self.plan_log[-1])
                self.metrics.write(row)
                return row
            self.retries += 1
            self.log(f"[{self.planner.name} w{self.cfg.rank}] round {it}: attempt {attempt + 1} incomplete "
                     f"(failed pairs {list(decision.failed_pairs)}, silent {list(decision.dead)}); replanned, "
                     f"reducing the same gradients again")
        raise TrainingFailed(f"worker {self.cfg.rank}: round {it}: {MAX_RETRIES + 1} attempts of the reduce were "
                             f"incomplete even after replanning; the survivors' graph may have no ring")

    def _finish_round(self, it: int, res, wall: float, reduce_s: float, write: bool = True) -> dict:
        st = self._round
        if not np.isfinite(self.params).all():
            raise TrainingFailed(f"worker {self.cfg.rank}: parameters became non-finite at round {it}; lower --lr")
        self.iteration += 1
        n = max(1, self.n)
        frac = st.get("delivered", 0) / (n * max(1, self.cfg.world_size))
        row = {"event": "iteration", "t": time.time(), "rank": self.cfg.rank, "iteration": it,
               "epoch": it // self.ipe, "workers": self.cfg.world_size, "contributors": st.get("contributors", 0),
               "gather_s": reduce_s, "broadcast_s": None, "round_s": wall, "compute_max_s": st.get("compute_s", 0.0),
               "delivered": {str(self.cfg.rank): frac}, "missing_steps": len(res.missing),
               "loss": st.get("loss", float("nan")), "samples": st.get("samples", 0)}
        if write:
            self.metrics.write(row)
        return row

    def _end_epoch(self, rows: list) -> None:
        if self.cfg.rank != 0:
            return
        epoch = (self.iteration - 1) // self.ipe
        ev = self.workload.evaluate(self.params) if self.cfg.evaluate else {}
        sync = [r["gather_s"] for r in rows] or [float("nan")]
        fr = [f for r in rows for f in r["delivered"].values()] or [float("nan")]
        row = {"event": "epoch", "t": time.time(), "epoch": epoch, "iteration": self.iteration,
               "loss": epoch_loss(rows, self.workload.reports_loss),
               "sync_mean_s": float(np.mean(sync)), "delivered_mean": float(np.mean(fr)),
               "workers": self.cfg.world_size, **ev}
        self.metrics.write(row)
        acc = f"acc {ev['accuracy']:.4f}  " if "accuracy" in ev else ""
        line = (f"[{self.planner.name} w0] epoch {epoch + 1:>3}/{self.epochs_total}  {acc}loss {figure(row['loss'], '.4f')}  "
                f"reduce {row['sync_mean_s'] * 1e3:7.2f} ms  delivered {row['delivered_mean']:.4f}")
        self.epoch_lines.append(line)
        self.log(line)

