"""Shared fixtures: a simulated two-host (or N-host) network of engines."""

from __future__ import annotations

import random

import numpy as np
import pytest

from ltp.config import Config
from ltp.engine import Engine
from ltp.sim import SimNetwork


class SimHarness:
    """Engines on a :class:`SimNetwork` plus helpers to wait for their events."""

    def __init__(self, n_hosts: int = 2, seed: int = 0, config: Config | None = None, configs=None, *,
                 gather_send: bool = False, interleave_parts: bool = False) -> None:
        """``gather_send`` and ``interleave_parts`` go to every :class:`Engine` and to the :class:`SimNetwork`."""
        self.net = SimNetwork(seed=seed, interleave_parts=interleave_parts)
        self.addrs = [(f"10.0.0.{i + 1}", 7447) for i in range(n_hosts)]
        self.engines = []
        for i, addr in enumerate(self.addrs):
            cfg = configs[i] if configs else (config or Config())
            eng = Engine(cfg, rng=random.Random(seed * 1000 + i), gather_send=gather_send)
            self.engines.append(eng)
            self.net.add_host(addr, eng)
        self.events: list = []

    def link(self, src: int, dst: int, **params):
        return self.net.set_link(self.addrs[src], self.addrs[dst], **params)

    def links(self, **params) -> None:
        """Set every directed link; ``loss`` drops any datagram, REGs and ACKs included, unless ``loss_min_size``
        spares the smaller ones."""
        for i in range(len(self.addrs)):
            for j in range(len(self.addrs)):
                if i != j:
                    self.link(i, j, **params)

    def _drain(self) -> None:
        for idx, eng in enumerate(self.engines):
            while (ev := eng.next_event()) is not None:
                self.events.append((idx, ev))

    def wait(self, handles, timeout: float = 60.0):
        """Run the virtual clock until every (engine index, handle) has its event; return them in order."""
        want = list(handles)

        def done():
            self._drain()
            got = {(i, e.handle) for i, e in self.events}
            return all(w in got for w in want)

        self.net.run(until=self.net.now + timeout, stop=done)
        self._drain()
        out = []
        for idx, h in want:
            evs = [e for i, e in self.events if e.handle == h and i == idx]
            assert evs, f"no event for handle {h} of engine {idx} by t={self.net.now:.3f}"
            out.append(evs[-1])
        return out

    @property
    def now(self) -> float:
        return self.net.now


@pytest.fixture
def harness():
    return SimHarness


@pytest.fixture
def floats():
    def make(n: int, seed: int = 0) -> np.ndarray:
        return np.random.default_rng(seed).standard_normal(n).astype(np.float32)

    return make
