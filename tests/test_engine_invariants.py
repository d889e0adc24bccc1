"""Bookkeeping invariants across the engine's split (admission counts, memory, matching), under random traffic.

Between any two simulator steps a receiver must satisfy:

* every open or pending receive flow is counted once per source address and once per source host;
* receive memory is exactly the bitmaps of open flows plus the internal buffers of unexpected messages;
* waiting slots belong to unfinished groups and have neither a flow nor a report;
* the next timer is the minimum of the named timers.
"""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ltp.config import Config
from ltp.engine import Engine
from ltp.sim import SimNetwork


def _check(eng: Engine) -> None:
    adm = eng._admission
    open_and_pending = [f.peer for f in eng._rx.values()] + [p.peer for p in adm.pending.values()]
    per_peer, per_host = {}, {}
    for peer in open_and_pending:
        per_peer[peer] = per_peer.get(peer, 0) + 1
        per_host[peer[0]] = per_host.get(peer[0], 0) + 1
    assert adm.per_peer == per_peer and adm.per_host == per_host
    m = eng._matcher
    # an unexpected message holds its bytes on the peer's behalf, unless it landed in a buffer the caller hinted
    expect = sum(f.seg_count for f in eng._rx.values()) + sum(f.total for f in m.unexpected if not f.placed)
    assert adm.memory == expect == sum(adm.host_memory.values())
    assert all(v > 0 for v in adm.host_memory.values())
    for s in m.waiting:
        assert s.flow is None and s.report is None and not s.group.done and s.group.handle in m.groups
    table = eng.timers()
    assert eng.get_timer() == table.next_deadline()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), loss=st.sampled_from([0.0, 0.05, 0.3]), n_senders=st.integers(1, 4),
       cap=st.integers(1, 3), memory=st.sampled_from([60_000, 10**9]), keyed=st.booleans())
def test_receiver_bookkeeping_holds_under_random_traffic(seed, loss, n_senders, cap, memory, keyed):
    r = random.Random(seed)
    cfg = Config(max_flows_per_peer=cap, max_receive_memory=memory, job_key=b"j" * 32 if keyed else None)
    net = SimNetwork(seed=seed)
    addrs = [(f"10.0.0.{i + 1}", 7447) for i in range(n_senders + 1)]
    engs = [Engine(cfg, rng=random.Random(seed * 10 + i), local_addr=a) for i, a in enumerate(addrs)]
    for a, e in zip(addrs, engs):
        net.add_host(a, e)
    for i in range(len(addrs)):
        for j in range(len(addrs)):
            if i != j:
                net.set_link(addrs[i], addrs[j], rate=125e6 / r.choice([1, 4]), delay_s=0.0005, loss=loss,
                             jitter_s=r.choice([0.0, 0.0002]), loss_min_size=200)
    rx = engs[0]
    groups = []
    hinted: list = []
    for _ in range(40):
        op = r.random()
        k = r.randrange(1, n_senders + 1)
        tag = r.randrange(4)
        if op < 0.45:
            engs[k].send(addrs[0], np.zeros(r.choice([500, 8000, 40000]), np.float32), now=net.now, tag=tag)
        elif op < 0.8:
            peers = r.sample(range(1, n_senders + 1), r.randint(1, n_senders))
            slots = [(addrs[p] if r.random() < 0.8 else None, tag if r.random() < 0.8 else None,
                      np.zeros(r.choice([500, 8000, 40000]), np.float32)) for p in peers]
            groups.append(rx.post_receive(slots, now=net.now, timeout=r.choice([None, 0.05, 0.5])))
        elif op < 0.85 and groups:
            rx.cancel(r.choice(groups), now=net.now)
        elif op < 0.93:  # a placement hint, sometimes on a buffer an earlier hint named (ltp/placement.py)
            hinted.append(np.zeros(r.choice([500, 8000, 40000]), np.float32) if not hinted or r.random() < 0.6
                          else r.choice(hinted))
            rx.expect(addrs[k], tag, hinted[-1], now=net.now)
        else:
            rx.peer_unreachable(addrs[k], now=net.now, cause="test")
        for _ in range(r.randint(1, 5)):
            net.run(until=net.now + r.choice([0.0005, 0.005, 0.05]))
            _check(rx)
        for e in engs:
            while e.next_event() is not None:
                pass
    # every timer, idle rule and TTL has passed by then: a message the idle rule closes (its sender went silent)
    # is kept unclaimed for the TTL from that close
    end = net.now + max(40.0, cfg.idle_timeout_s + cfg.unclaimed_ttl_s + 1.0)
    net.run(until=end)  # (the simulator's clock stops at its last event when none is left)
    _check(rx)
    # unclaimed messages are purged lazily, on the next timer run (they arm no timer of their own); the clock
    # stopped at the last event, and a message closed then (the idle rule) is kept the TTL from its close
    rx.handle_timer(max(end, net.now + cfg.idle_timeout_s + cfg.unclaimed_ttl_s + 1.0))
    _check(rx)
    assert not rx._rx and not rx._admission.pending and rx.receive_memory == 0
