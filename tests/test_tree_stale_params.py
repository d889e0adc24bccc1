"""A tree worker whose parameter slice did not come down in time computes on the slice it holds (ltp_ps.program_roles).

Found in the lab: RAT with six colocated shards and one worker's egress throttled to 1 Mbit/s; a parameter
hop through the throttled aggregator timed out, the receive buffer held nothing, and every worker behind it
exited with "parameter message with bad magic".
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from ltp_ps.errors import RemoteError, TransportTimeout
from ltp_ps.program_roles import _WorkerHandlers
from ltp_ps.schedules.executor import Slots
from ltp_ps.schedules.program import Compute
from ltp_ps.sharding import ShardPlan
from ltp_ps.transport import MemoryNetwork
from ltp_ps.wire import ELEM, HEADER_BYTES, KIND_PARAMS, ParamsHeader
from ltp_ps.worker import ShardRef, Worker, WorkerConfig
from ps_helpers import workload


def _worker(k=2):
    wl = workload()
    net = MemoryNetwork(loss=0.0, segment_size=1024, seed=0)
    plan = ShardPlan(wl.n_params, k)
    refs = [ShardRef(s, ("127.0.0.1", 9000 + s), lo, hi) for s, (lo, hi) in enumerate(plan.ranges)]
    w = Worker(wl, net.endpoint(), refs, WorkerConfig(rank=0, world_size=2, seed=3))
    w._batches = wl.batches(0, 2, 3)
    return wl, w


def _write(w, s, it, values):
    ref = w.shards[s]
    n = ref.hi - ref.lo
    ParamsHeader(KIND_PARAMS, s, it, it, n, 0, 0).pack_into(w._in[s])
    w._in[s][HEADER_BYTES:HEADER_BYTES + ELEM * n].view(np.float32)[:] = values


def _compute(w, it):
    return asyncio.run(_WorkerHandlers(w, it).compute(Compute(), Slots()))


def test_a_missing_slice_in_the_first_round_uses_the_initial_parameters_and_is_counted(capsys):
    wl, w = _worker()
    a = w.shards[0]
    _write(w, 0, 0, np.full(a.hi - a.lo, 0.5, np.float32))  # shard 1's message never came
    assert _compute(w, 0) is None
    init = wl.initial_params(3)
    b = w.shards[1]
    np.testing.assert_array_equal(w.flat[b.lo:b.hi], init[b.lo:b.hi])
    assert (w.flat[a.lo:a.hi] == 0.5).all()
    assert w.stale_param_slices == 1
    assert "no parameters from shard(s) [1]" in capsys.readouterr().out


def test_a_slice_left_from_an_earlier_round_is_kept_not_copied_again():
    wl, w = _worker()
    for s, ref in enumerate(w.shards):
        _write(w, s, 0, np.full(ref.hi - ref.lo, 1.0 + s, np.float32))
    _compute(w, 0)
    a, b = w.shards
    _write(w, 0, 1, np.full(a.hi - a.lo, 7.0, np.float32))
    w._in[1][HEADER_BYTES:HEADER_BYTES + 16] = 0  # a partial overwrite of the old message's payload: ignored
    _compute(w, 1)  # shard 1 still holds round 0's message
    assert (w.flat[a.lo:a.hi] == 7.0).all() and (w.flat[b.lo:b.hi] == 2.0).all()
    assert w.stale_param_slices == 1


def test_no_slice_at_all_is_a_timeout_and_a_future_round_is_an_error():
    wl, w = _worker()
    with pytest.raises(TransportTimeout, match="no parameters of any shard for round 0"):
        _compute(w, 0)
    for s, ref in enumerate(w.shards):
        _write(w, s, 5, np.zeros(ref.hi - ref.lo, np.float32))
    with pytest.raises(RemoteError, match="round 5 while running round 2"):
        _compute(w, 2)
