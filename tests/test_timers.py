"""The named timer table (ltp.timers) and the engine's use of it (virtual clock, no sockets)."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ltp.config import Config
from ltp.engine import Engine
from ltp.timers import DeadlineHeap, Timer, TimerTable

PEER = ("10.0.0.2", 7447)


def test_table_keeps_the_earliest_per_kind_and_the_minimum_overall():
    t = TimerTable()
    assert t.next_deadline() is None and t.as_dict() == {} and t.due(1e9) == []
    t.arm(Timer.ACK_DELAY, 5.0)
    t.arm(Timer.ACK_DELAY, 7.0)  # later: ignored
    t.arm(Timer.ACK_DELAY, None)  # nothing
    t.arm(Timer.PACING, 6.0)
    t.arm(Timer.ACK_DELAY, 4.5)
    assert t.get(Timer.ACK_DELAY) == 4.5 and t.get(Timer.IDLE_SCAN) is None
    assert t.next_deadline() == 4.5
    assert t.due(5.9) == [Timer.ACK_DELAY] and t.due(6.0) == [Timer.ACK_DELAY, Timer.PACING]
    assert t.as_dict() == {Timer.ACK_DELAY: 4.5, Timer.PACING: 6.0}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(list(Timer)), st.floats(0, 1e6)), max_size=40))
def test_table_minimum_is_the_minimum_of_everything_armed(arms):
    t = TimerTable()
    for kind, at in arms:
        t.arm(kind, at)
    assert t.next_deadline() == (min(at for _, at in arms) if arms else None)
    for kind in Timer:
        mine = [at for k, at in arms if k == kind]
        assert t.get(kind) == (min(mine) if mine else None)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 100), max_size=50), st.floats(0, 100))
def test_heap_pops_due_keys_by_deadline_then_push_order(times, now):
    h = DeadlineHeap()
    for i, t in enumerate(times):
        h.push(t, i)
    assert h.next_time() == (min(times) if times else None)
    popped = []
    while (k := h.pop_due(now)) is not None:
        popped.append(k)
    assert popped == sorted((i for i, t in enumerate(times) if t <= now), key=lambda i: (times[i], i))
    assert len(h) == sum(1 for t in times if t > now)
    h.clear()
    assert len(h) == 0 and h.next_time() is None and h.pop_due(1e9) is None


def test_engine_names_which_timer_is_next():
    cfg = Config()
    eng = Engine(cfg, rng=random.Random(1), local_addr=("10.0.0.1", 7447))
    assert eng.timers().as_dict() == {} and eng.get_timer() is None
    eng.send(PEER, np.zeros(1000, np.float32), now=0.0)
    eng.datagrams_to_send(0.0)
    armed = eng.timers()
    # an unanswered REG: its repeat is the earliest deadline, the dead-peer rule is armed behind it
    assert armed.get(Timer.REG_REPEAT) is not None and armed.get(Timer.PEER_SILENCE) is not None
    assert armed.get(Timer.PEER_SILENCE) == cfg.peer_silence_min_s
    assert eng.get_timer() == armed.next_deadline() == min(armed.as_dict().values())
    h = eng.post_receive([(PEER, 3, bytearray(16))], now=0.0, timeout=0.25)
    assert eng.timers().get(Timer.RECEIVE_GROUP) == 0.25
    eng.handle_timer(0.25)
    ev = eng.next_event()
    assert ev.handle == h and ev.reports[0].regime == "timeout"
    assert eng.timers().get(Timer.RECEIVE_GROUP) is None
    # keep firing the earliest timer: the send ends by the dead-peer rule, and every kind seen is named
    seen = set()
    while (t := eng.get_timer()) is not None and t < 60:
        seen.update(eng.timers().due(t))
        eng.handle_timer(t)
        eng.datagrams_to_send(t)
    ev = eng.next_event()
    assert ev is not None and type(ev.error).__name__ == "TransferTimeout"
    assert {Timer.REG_REPEAT, Timer.PEER_SILENCE} <= seen


def test_next_time_skips_keys_no_longer_alive_at_the_front():
    h = DeadlineHeap()
    for at, key in ((1.0, "a"), (2.0, "b"), (3.0, "c")):
        h.push(at, key)
    alive = {"b", "c"}
    assert h.next_time() == 1.0  # without a predicate: the earliest entry, stale or not
    assert h.next_time(alive.__contains__) == 2.0 and len(h) == 2  # "a" was dropped
    alive.clear()
    assert h.next_time(alive.__contains__) is None and len(h) == 0
    h.push(5.0, "d")
    assert h.next_time(lambda k: True) == 5.0 and h.pop_due(5.0) == "d"
