"""Contiguous-range sharding of the flat model over PS processes (ps-lite's key slicer)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """``n_elems`` split into ``n_shards`` contiguous ranges of near-equal size.

    Boundaries are rounded to ``align`` elements (a multiple of typical segment
    payloads) except the last.  ``ranges[s] = (lo, hi)``, half-open.
    """

    n_elems: int
    n_shards: int = 1
    align: int = 256

    def __post_init__(self):
        from .errors import ConfigError

        if self.n_shards < 1:
            raise ConfigError("--num-servers must be >= 1")
        if self.n_elems < self.n_shards:
            raise ConfigError(f"cannot split {self.n_elems} parameters over {self.n_shards} servers")

    @property
    def ranges(self) -> list[tuple]:
        out, lo = [], 0
        for s in range(self.n_shards):
            if s == self.n_shards - 1:
                hi = self.n_elems
            else:
                hi = (self.n_elems * (s + 1)) // self.n_shards
                hi = max(lo + 1, (hi // self.align) * self.align) if hi - lo > self.align else hi
            out.append((lo, hi))
            lo = hi
        return out

    def split(self, flat):
        """Views of ``flat`` (numpy or torch, 1-D) per shard, in shard order."""
        return [flat[lo:hi] for lo, hi in self.ranges]

    def shard_of(self, index: int) -> int:
        for s, (lo, hi) in enumerate(self.ranges):
            if lo <= index < hi:
                return s
        raise IndexError(index)
