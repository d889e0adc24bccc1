"""A tree worker whose parameter slice did not come down in time computes on the slice it holds (ltp_ps.program_roles).

Found in the lab: RAT with six colocated shards and one worker's egress throttled to 1 Mbit/s; a parameter
hop through the throttled aggregator timed out, the receive buffer held nothing, and every worker behind it
exited with "parameter message with bad magic".
"""

from __future__ import annotations

import asyncio
import dataclasses

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


def _after_round_0(w):
    """Round 0 completes with shard s's parameters all ``1 + s``; returns the shard refs."""
    for s, ref in enumerate(w.shards):
        _write(w, s, 0, np.full(ref.hi - ref.lo, 1.0 + s, np.float32))
    _compute(w, 0)
    return w.shards


def test_a_slice_left_from_an_earlier_round_is_kept_not_copied_again():
    wl, w = _worker()
    a, b = _after_round_0(w)
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


def _report(n, *, complete=True):
    from ltp_ps.transport.base import CANCELLED, COMPLETE, RecvReport

    got = n if complete else n // 2
    return RecvReport(peer=("p", 1), tag=1, total_bytes=n, received_bytes=got, delivered_fraction=got / n,
                      bubbles=() if complete else ((got, n),), critical_complete=True,
                      regime=COMPLETE if complete else CANCELLED, duration_s=0.0)


def test_a_parameter_message_cut_short_with_its_header_in_is_not_trained_on():
    # the sender gave up (timeout: RESET), the receiver zero-filled the rest; the header says "this round"
    wl, w = _worker()
    a, b = _after_round_0(w)
    _write(w, 0, 1, np.full(a.hi - a.lo, 7.0, np.float32))
    _write(w, 1, 1, np.zeros(b.hi - b.lo, np.float32))  # zero-filled after a cut
    sl = Slots()
    sl.reports["p0"], sl.reports["p1"] = _report(100), _report(100, complete=False)
    asyncio.run(_WorkerHandlers(w, 1, param_slots={"p0": 0, "p1": 1}).compute(Compute(), sl))
    assert (w.flat[a.lo:a.hi] == 7.0).all() and (w.flat[b.lo:b.hi] == 2.0).all()  # round 0's slice kept
    assert w.stale_param_slices == 1


def test_an_empty_relay_means_compute_on_what_is_held_not_a_timeout():
    wl, w = _worker()
    for s, ref in enumerate(w.shards):
        _write(w, s, 0, np.full(ref.hi - ref.lo, 3.0, np.float32))
    _compute(w, 0)
    for s in range(2):  # every aggregator above had no whole copy this round: header only, n_elems = 0
        ParamsHeader(KIND_PARAMS, s, 1, 1, 0, 0, 0).pack_into(w._in[s])
    assert _compute(w, 1) is None
    assert (w.flat == 3.0).all() and w.stale_param_slices == 2


def test_a_relay_is_bounded_by_its_share_of_the_round_and_relays_nothing_it_does_not_hold_whole():
    from ltp_ps.schedules.program import Forward
    from ltp_ps.wire import KIND_STOP

    wl, w = _worker()
    a = w.shards[0]
    h = _WorkerHandlers(w, 4, levels=2, param_slots={"params:0": 0})
    sl = Slots()
    sl.bind("params:0", w._in[0])
    fwd = Forward("worker:1", "params:0", a.lo, a.hi, 9, "reliable", "params")
    ParamsHeader(KIND_PARAMS, 0, 4, 4, a.hi - a.lo, 0, 0, 3000).pack_into(w._in[0])  # the PS's bound: 3 s
    sl.reports["params:0"] = _report(100)
    step = h.prepare_transfer(fwd, sl)
    assert step.slot == "params:0" and step.timeout_s == pytest.approx(1.0)  # 3 s / (levels + 1)
    sl.reports["params:0"] = _report(100, complete=False)
    step = h.prepare_transfer(fwd, sl)
    assert step.slot == "params:0:empty" and step.timeout_s == pytest.approx(1.0)
    e = ParamsHeader.unpack(sl.buffer(step.slot))
    assert (e.kind, e.shard, e.iteration, e.n_elems, e.round_bound_ms) == (KIND_PARAMS, 0, 4, 0, 3000)
    assert sl.buffer(step.slot).nbytes == HEADER_BYTES
    ParamsHeader(KIND_STOP, 0, 4, 4, 0, 0, 0).pack_into(w._in[0])  # STOP goes down as it came
    assert h.prepare_transfer(fwd, sl) is None
    w._in[0][:HEADER_BYTES] = 0  # nothing came: an empty relay of this round, with the last known bound
    step = h.prepare_transfer(fwd, sl)
    assert ParamsHeader.unpack(sl.buffer(step.slot)).iteration == 4 and step.timeout_s == pytest.approx(1.0)
    assert h.prepare_transfer(dataclasses.replace(fwd, payload="partial"), sl) is None  # only parameter relays
    assert w.empty_relays == 2


def _tree_worker(rank, workers=3):
    """A worker of a one-shard RAT tree (worker 0 aggregates and relays the parameters to the others)."""
    from ltp_ps.schedules.base import World
    from ltp_ps.schedules.rat import RatSchedule

    wl = workload()
    net = MemoryNetwork(loss=0.0, segment_size=1024, seed=0)
    refs = [ShardRef(0, ("127.0.0.1", 9000), 0, wl.n_params)]
    planner = RatSchedule(World(workers=range(workers), n_elems=wl.n_params, shards=((0, wl.n_params),)))
    w = Worker(wl, net.endpoint(), refs, WorkerConfig(rank=rank, world_size=workers, seed=3, max_iterations=1),
               planner=planner)
    w._batches = wl.batches(rank, workers, 3)
    return wl, w


@pytest.mark.parametrize("came", ["nothing", "cut short"])
def test_a_round_whose_relay_died_mid_message_computes_and_goes_on_rather_than_rejoin(came):
    # Seen in CI (RAT, the aggregator SIGKILLed while relaying round 1's parameters): the worker's receive was
    # abandoned when the board declared the relay dead, and its report counted no bytes, though the header and
    # part of the slice had come; the worker computed on the parameters it held, and then the round's end said
    # "no parameters for round 1" and made it rejoin, which starved its own children in the repaired tree
    from ltp_ps.program_roles import worker_run
    from ltp_ps.schedules.executor import RunResult
    from ltp_ps.transport.base import missing_report

    wl, w = _tree_worker(rank=1)
    calls = []

    async def run(prog, slots, handlers, *, iteration, exclude=()):
        steps = prog.steps()
        recv = next(st for st in steps if st.op == "recv" and st.payload == "params")
        assert recv.peer == "worker:0"
        report = missing_report(("127.0.0.1", 1), recv.tag, 4000, "cancelled", 0.5)
        slots.reports[recv.slot] = report
        if came == "cut short":  # the header and the first part of the slice, the rest zero
            buf = slots.buffer(recv.slot)
            ParamsHeader(KIND_PARAMS, 0, iteration, iteration, wl.n_params, 0, 0).pack_into(buf)
        step = next(st for st in steps if st.op == "compute")
        calls.append(await handlers.compute(step, slots))
        return RunResult(reports=[report if st is recv else None for st in steps], group_s={})

    w.executor.run = run
    if came == "nothing":  # no parameter message at all, and nobody declared dead: a timeout, as before
        with pytest.raises(TransportTimeout, match="no parameters of any shard for round 0"):
            asyncio.run(worker_run(w))
        return
    out = asyncio.run(worker_run(w))
    assert calls == [None] and out["iterations"] == 1 and not out["stopped"]
    assert w.stale_param_slices == 1  # computed on the parameters it held, and said so
