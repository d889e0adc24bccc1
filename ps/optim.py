"""Optimizers applied at the PS on the flat float32 parameter buffer (real torch optimizers)."""

from __future__ import annotations

import numpy as np
import torch

from .errors import ConfigError

OPTIMIZERS = ("sgd", "adam")


class FlatOptimizer:
    """A torch optimizer over one flat parameter that *shares memory* with ``params``.

    ``params`` is a float32 numpy array (e.g. the payload of the broadcast
    buffer); ``step(grad)`` writes the update in place, so the next broadcast
    sends it without a copy.  Elementwise optimizers (SGD, Adam) give the same
    result whether the model is one shard or many.
    """

    def __init__(self, params: np.ndarray, kind: str = "sgd", *, lr: float = 0.05, momentum: float = 0.9,
                 weight_decay: float = 0.0, betas=(0.9, 0.999), eps: float = 1e-8):
        if params.dtype != np.float32 or params.ndim != 1:
            raise ConfigError("FlatOptimizer needs a 1-D float32 buffer")
        self.kind = kind
        self.param = torch.nn.Parameter(torch.from_numpy(params), requires_grad=True)
        if kind == "sgd":
            self.opt = torch.optim.SGD([self.param], lr=lr, momentum=momentum, weight_decay=weight_decay)
        elif kind == "adam":
            self.opt = torch.optim.Adam([self.param], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        else:
            raise ConfigError(f"unknown optimizer {kind!r}; use one of {OPTIMIZERS}")

    @property
    def lr(self) -> float:
        return self.opt.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = value

    @torch.no_grad()
    def step(self, grad: np.ndarray) -> None:
        self.param.grad = torch.from_numpy(np.ascontiguousarray(grad, dtype=np.float32))
        self.opt.step()
        self.param.grad = None

    def state_dict(self):
        return self.opt.state_dict()

    def load_state_dict(self, sd) -> None:
        self.opt.load_state_dict(sd)
