"""Workloads: what a worker computes and what the PS evaluates.

* ``digits``: a small CNN on scikit-learn's 8x8 digits (ships with sklearn;
  fixed 80/20 train/test split), reaches >95% test accuracy in seconds.
* ``resnet50`` / ``vgg16`` / ``synthetic:<n>``: parameter sets of that size
  (25.6M / 138.4M float32) with random gradients and a configurable compute
  delay, for batch-synchronisation-time experiments.
* :class:`ModuleWorkload`: any ``nn.Module`` with a loss and a batch iterator.

The model is seen by the PS as one flat float32 vector; ``layout()`` gives the
``(offset, numel)`` of every tensor (for the critical ranges).
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Callable, Iterator

import numpy as np
import torch
from torch import nn

from .datasets import digits_split
from .model_names import synthetic_params


def flat_layout(module: nn.Module) -> list[tuple]:
    out, off = [], 0
    for p in module.parameters():
        out.append((off, p.numel()))
        off += p.numel()
    return out


def get_flat(module: nn.Module) -> np.ndarray:
    return torch.nn.utils.parameters_to_vector(module.parameters()).detach().numpy().astype(np.float32)


def set_flat(module: nn.Module, flat) -> None:
    torch.nn.utils.vector_to_parameters(torch.as_tensor(flat), module.parameters())


def flat_grad(module: nn.Module) -> np.ndarray:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in module.parameters()]).numpy()


class Workload:
    name = "abstract"
    batch_size = 32
    chance_accuracy: float | None = None  # test accuracy of always guessing the commonest label; None: not judged
    #: ``compute`` returns a real training loss. False (synthetic gradients): its 0.0 is a placeholder the health
    #: checks accept, and the epoch lines and metrics show no loss ('-' / NaN) rather than a made-up 0.0000
    reports_loss = True

    def build_model(self) -> nn.Module | None:
        return None

    @property
    def n_params(self) -> int:
        raise NotImplementedError

    def layout(self) -> list[tuple]:
        return [(0, self.n_params)]

    def initial_params(self, seed: int = 0) -> np.ndarray:
        raise NotImplementedError

    def iters_per_epoch(self, n_workers: int) -> int:
        return 1

    def batches(self, rank: int, n_workers: int, seed: int = 0) -> Iterator:
        raise NotImplementedError

    def compute(self, model, batch) -> tuple[np.ndarray, float, int]:
        """(flat gradient, loss, samples) for one batch at the current parameters."""
        raise NotImplementedError

    def evaluate(self, flat: np.ndarray) -> dict:
        return {}


class ModuleWorkload(Workload):
    """Any ``nn.Module``: ``loss_fn(model(x), y)`` on batches from ``make_batches(rank, n, seed)``."""

    def __init__(self, name: str, model_fn: Callable[[], nn.Module], loss_fn, make_batches,
                 iters_per_epoch: Callable[[int], int] | None = None, evaluate=None, compute_delay_s: float = 0.0):
        self.name = name
        self.compute_delay_s = compute_delay_s  # extra seconds per step (slow-worker experiments)
        self._model_fn = model_fn
        self._proto = model_fn()
        self.loss_fn = loss_fn
        self._make_batches = make_batches
        self._ipe = iters_per_epoch
        self._evaluate = evaluate

    def build_model(self):
        return self._model_fn()

    @property
    def n_params(self):
        return sum(p.numel() for p in self._proto.parameters())

    def layout(self):
        return flat_layout(self._proto)

    def initial_params(self, seed: int = 0):
        torch.manual_seed(seed)
        return get_flat(self._model_fn())

    def iters_per_epoch(self, n_workers):
        return self._ipe(n_workers) if self._ipe else 1

    def batches(self, rank, n_workers, seed=0):
        return self._make_batches(rank, n_workers, seed)

    def compute(self, model, batch):
        x, y = batch
        model.train()
        model.zero_grad(set_to_none=False)
        loss = self.loss_fn(model(x), y)
        loss.backward()
        if self.compute_delay_s:
            time.sleep(self.compute_delay_s)
        return flat_grad(model), float(loss.detach()), len(y)

    def evaluate(self, flat):
        return self._evaluate(flat) if self._evaluate else {}


class DigitsCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def digits_data(seed: int = 0):
    """(x_train, y_train, x_test, y_test) tensors; fixed stratified 80/20 split (cached: :mod:`ltp_ps.datasets`)."""
    xtr, ytr, xte, yte = digits_split(seed)
    return torch.from_numpy(xtr), torch.from_numpy(ytr), torch.from_numpy(xte), torch.from_numpy(yte)


class DigitsWorkload(ModuleWorkload):
    def __init__(self, batch_size: int = 32, seed: int = 0, compute_delay_s: float = 0.0):
        self.batch_size = batch_size
        self.xtr, self.ytr, self.xte, self.yte = digits_data(seed)
        self.chance_accuracy = float(torch.bincount(self.yte).max()) / len(self.yte)
        super().__init__("digits", DigitsCNN, nn.functional.cross_entropy, self._batches,
                         self._ipe, self._eval, compute_delay_s)
        self._eval_model = DigitsCNN()

    def _ipe(self, n_workers):
        return math.ceil(len(self.ytr) / n_workers / self.batch_size)

    def _batches(self, rank, n_workers, seed):
        idx = torch.arange(rank, len(self.ytr), n_workers)
        g = torch.Generator().manual_seed(seed * 1000 + rank)
        for _ in itertools.count():
            perm = idx[torch.randperm(len(idx), generator=g)]
            for i in range(0, len(perm), self.batch_size):
                b = perm[i:i + self.batch_size]
                yield self.xtr[b], self.ytr[b]

    @torch.no_grad()
    def _eval(self, flat):
        set_flat(self._eval_model, flat)
        self._eval_model.eval()
        out = self._eval_model(self.xte)
        return {"accuracy": float((out.argmax(1) == self.yte).float().mean()),
                "test_loss": float(nn.functional.cross_entropy(out, self.yte))}


class SyntheticWorkload(Workload):
    """A parameter set of ``n`` float32 with random gradients after ``compute_delay_s`` seconds (no loss)."""

    reports_loss = False

    def __init__(self, name: str, n: int, compute_delay_s: float = 0.0, tensors: int = 160,
                 iters_per_epoch: int = 10):
        self.name = name
        self._n = n
        self.compute_delay_s = compute_delay_s
        self._tensors = max(1, min(tensors, n))
        self._ipe = iters_per_epoch

    @property
    def n_params(self):
        return self._n

    def layout(self):
        step = self._n // self._tensors
        return [(i * step, step if i < self._tensors - 1 else self._n - i * step) for i in range(self._tensors)]

    def initial_params(self, seed=0):
        return np.random.default_rng(seed).standard_normal(self._n, dtype=np.float32) * np.float32(0.01)

    def iters_per_epoch(self, n_workers):
        return self._ipe

    def batches(self, rank, n_workers, seed=0):
        rng = np.random.default_rng(seed * 1000 + rank)
        base = rng.standard_normal(self._n, dtype=np.float32) * np.float32(1e-3)
        for i in itertools.count():
            yield i, base

    def compute(self, model, batch):
        i, base = batch
        if self.compute_delay_s:
            time.sleep(self.compute_delay_s)
        return base, 0.0, 1


def get_workload(name: str, *, compute_delay_s: float = 0.0, batch_size: int = 32, seed: int = 0) -> Workload:
    n = synthetic_params(name)
    if n is None:
        return DigitsWorkload(batch_size=batch_size, seed=seed, compute_delay_s=compute_delay_s)
    return SyntheticWorkload(name, n, compute_delay_s)
