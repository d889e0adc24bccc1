"""Atomic checkpoints of a PS shard: write to a temp file, fsync, ``os.replace``.

A crash while saving leaves the previous checkpoint intact; ``load_latest``
never sees a half-written file.  One file per shard:
``<dir>/ps-shard<k>.pt`` holding params, optimizer state, iteration, version
and the model fingerprint (size, dtype, shard range) checked on resume.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from .atomic_file import write_atomically
from .errors import ConfigError


def checkpoint_path(directory: str, shard: int) -> str:
    return os.path.join(directory, f"ps-shard{shard}.pt")


def save_checkpoint(directory: str, shard: int, *, params: np.ndarray, optimizer_state: dict,
                    iteration: int, version: int, n_params: int, shard_range: tuple,
                    dtype: str = "float32", extra: dict | None = None) -> str:
    os.makedirs(directory, exist_ok=True)
    path = checkpoint_path(directory, shard)
    state = {"format": 1, "params": torch.from_numpy(params.copy()), "optimizer": optimizer_state,
             "iteration": iteration, "version": version, "n_params": n_params,
             "shard_range": tuple(shard_range), "dtype": dtype, "extra": extra or {}}
    write_atomically(path, lambda f: torch.save(state, f), durable=True)
    return path


def load_latest(directory: str | None, shard: int, *, n_params: int, shard_range: tuple,
                dtype: str = "float32") -> dict | None:
    """The shard's checkpoint, or None.  Raises ConfigError if it is for another model."""
    if not directory:
        return None
    path = checkpoint_path(directory, shard)
    if not os.path.exists(path):
        return None
    state = torch.load(path, map_location="cpu", weights_only=False)
    if (state["n_params"], tuple(state["shard_range"]), state["dtype"]) != (n_params, tuple(shard_range), dtype):
        raise ConfigError(
            f"checkpoint {path} is for a model of {state['n_params']} {state['dtype']} parameters, shard "
            f"{tuple(state['shard_range'])}, but this job has {n_params} {dtype}, shard {tuple(shard_range)}; "
            f"use another --checkpoint-dir or delete the file")
    return state
