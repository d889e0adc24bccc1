"""Receiver-driven rate grants and egress shares (ltp/link_share.py), on the virtual clock."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from conftest import SimHarness
from hypothesis import given
from hypothesis import strategies as st

from ltp import wire
from ltp.config import Config
from ltp.errors import LocalProtocolError
from ltp.link_share import (GRANT_TTL_S, GRANT_UTILIZATION, GRANTED_MIN_BURST_PACKETS, PROVISIONAL_GRANT_S,
                             WIRE_OVERHEAD_BYTES, datagram_share)
from ltp.pacing import Pacer
from ltp.path import Path
from test_engine import GBIT, _incast_rounds

MSS = wire.HEADER_SIZE + 1456


@given(rate=st.floats(1e3, 1e11), n=st.integers(0, 5000), dgram=st.integers(17, 65507))
def test_shares_add_up_to_the_utilization_of_the_link_on_the_wire(rate, n, dgram):
    share = datagram_share(rate, n, dgram)
    senders = max(1, n)
    on_wire = senders * share * (dgram + WIRE_OVERHEAD_BYTES) / dgram
    assert on_wire == pytest.approx(GRANT_UTILIZATION * rate, rel=1e-9)


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), "1gbit", True])
def test_a_bad_link_rate_is_refused_naming_the_fix(bad):
    with pytest.raises(LocalProtocolError, match="bytes/s"):
        Config(link_rate=bad)


class _FixedModel:
    """Stands in for BBR: a constant pacing rate."""

    def __init__(self, rate: float) -> None:
        self.pacing_rate = rate


def _path(rate_bbr: float = 1e9) -> Path:
    p = Path(("10.0.0.2", 7447), Config(), random.Random(1), MSS)
    p.bbr = _FixedModel(rate_bbr)  # what BBR would pace at on its own
    p.pacer.set_rate(p.pacing_rate(0.0))
    return p


def test_a_grant_caps_the_pacer_and_lapses_when_not_renewed():
    p = _path(1e9)
    assert p.pacing_rate(0.0) == 1e9
    assert p.pacer.min_burst_bytes == Config().min_burst_packets * MSS
    p.on_grant(2e7, now=1.0)
    assert p.pacer.rate == 2e7 and p.pacing_rate(1.0) == 2e7
    assert p.pacer.min_burst_bytes == GRANTED_MIN_BURST_PACKETS * MSS  # granted: small bursts
    p.on_grant(5e9, now=1.5)  # a grant above BBR's rate does not raise it: BBR still measures the path
    assert p.pacing_rate(1.5) == 1e9
    assert p.pacer.min_burst_bytes == Config().min_burst_packets * MSS  # BBR limits it, not the grant
    p.on_grant(3e7, now=2.0)
    assert p.pacing_rate(2.0 + GRANT_TTL_S) == 3e7
    assert p.pacing_rate(2.0 + GRANT_TTL_S + 0.01) == 1e9 and p.grant is None
    p.set_egress_share(4e7, now=5.0)
    assert p.pacer.rate == 4e7
    p.set_egress_share(None, now=5.0)
    assert p.pacer.rate == 1e9


def test_a_path_restarting_after_idle_paces_at_its_smallest_recent_grant_from_a_random_phase():
    p = _path(1e9)
    for rate, t in ((6e7, 0.1), (1.5e7, 0.2), (1.2e8, 0.3)):  # the receiver's share grows as others finish
        p.on_grant(rate, now=t)
    p.pacer.available(0.3)
    assert p.pacer.available(0.5) == p.pacer.depth_bytes  # a full bucket after the idle time
    p.begin_busy(0.5)
    assert p.pacing_rate(0.5) == 1.5e7  # the share under full contention, until a fresh grant comes
    assert p.pacer.available(0.5) <= p.pacer.min_burst_bytes
    p.on_grant(4e7, now=0.6)
    assert p.pacing_rate(0.6) == 4e7
    # a busy period that ended long ago (past the grants' TTL) still guides the restart, provisionally
    p.begin_busy(30.0)
    assert p.pacing_rate(30.0) == 4e7 and p.pacing_rate(30.0 + 0.99 * PROVISIONAL_GRANT_S) == 4e7
    assert p.pacing_rate(30.0 + PROVISIONAL_GRANT_S + 0.01) == 1e9  # the receiver sent none: it lapsed
    p.begin_busy(40.0)  # nothing granted in the last busy period: nothing to guess from
    assert p.grant is None and p.pacing_rate(40.0) == 1e9


def test_pacer_restart_keeps_at_most_the_given_phase_of_a_minimum_burst():
    pc = Pacer(granularity_s=0.001, min_burst_bytes=12_000, rate=1e7)
    pc.available(0.0)
    pc.available(10.0)  # idle for 10 s: a full bucket
    assert pc.available(10.0) == pc.depth_bytes
    pc.restart(10.0, 0.25)
    assert pc.available(10.0) == 3000
    pc.consume(10.0, 3000)
    pc.restart(10.0, 1.0)  # never adds tokens
    assert pc.available(10.0) == 0


def _acks(h, src: int, dst: int):
    """Every ACK datagram engine ``src`` sent to engine ``dst`` (from the trace)."""
    out = []
    for _, s, d, data in h.net.trace:
        if s == h.addrs[src] and d == h.addrs[dst] and data[0] & 0x0F == wire.T_ACK:
            out.append(wire.unpack_header(data)[1:2] + (wire.ack_grant(data, wire.unpack_header(data)[1]),))
    return out


@pytest.mark.parametrize("senders", [1, 3])
def test_acks_grant_each_sender_an_equal_share_of_the_receivers_link_only_when_it_is_known(floats, senders):
    for link_rate in (None, GBIT):
        cfg = Config()
        h = SimHarness(n_hosts=senders + 1, seed=5, configs=[dataclasses.replace(cfg, link_rate=link_rate)]
                       + [cfg] * senders)
        h.net.trace = []
        data = [floats(200_000, i) for i in range(senders)]
        outs = [np.zeros_like(d) for d in data]
        hr = h.engines[0].post_receive([(h.addrs[i + 1], 0, outs[i]) for i in range(senders)], now=h.now)
        hs = [h.engines[i + 1].send(h.addrs[0], data[i], now=h.now) for i in range(senders)]
        evs = h.wait([(0, hr)] + [(i + 1, x) for i, x in enumerate(hs)])
        assert all(r.regime == "complete" for r in evs[0].reports)
        assert all(np.array_equal(o, d) for o, d in zip(outs, data))
        for i in range(senders):
            acks = _acks(h, 0, i + 1)
            assert acks
            if link_rate is None:
                assert all(flags == 0 and grant == 0 for flags, grant in acks)
                continue
            assert all(flags == wire.F_GRANT for flags, _ in acks)
            grants = [g for _, g in acks]
            # the registration's confirmation already carries one; while every sender is open each gets 1/n
            full = datagram_share(GBIT, senders, MSS)
            assert max(grants) <= datagram_share(GBIT, 1, MSS) * 1.001
            assert min(grants) == pytest.approx(full, rel=2e-3)
            assert h.engines[i + 1]._paths[h.addrs[0]].grant is not None


def test_an_ack_with_a_zero_or_malformed_grant_is_dropped_and_counted(floats):
    h = SimHarness(n_hosts=2, seed=1)
    a, b = h.engines
    hs = a.send(h.addrs[1], floats(50_000), now=h.now)
    flow = a._tx[next(iter(a._tx))]
    for raw, why in ((wire.pack_header(wire.T_ACK, wire.F_GRANT, flow.flow_id, flow.token, 0, 0) + bytes(4),
                      "bad_grant"),
                     (wire.pack_header(wire.T_ACK, wire.F_GRANT, flow.flow_id, flow.token, 0, 0), "bad_length"),
                     (wire.pack_header(wire.T_ACK, wire.F_GRANT, flow.flow_id, flow.token, 0, 0)
                      + (0x1234_0001).to_bytes(4, "big"), "bad_grant")):
        a.receive_datagram(raw, h.addrs[1], h.now)
        assert a.stats.dropped.get(why, 0) >= 1, (why, a.stats.dropped)
    assert a._paths[h.addrs[1]].grant is None
    hr = b.post_receive([(h.addrs[0], 0, np.zeros(50_000, np.float32))], now=h.now)
    sent, _ = h.wait([(0, hs), (1, hr)])
    assert sent.error is None


def test_egress_shares_split_the_senders_link_among_its_active_paths(floats):
    n = 4
    cfg = Config()
    h = SimHarness(n_hosts=n + 1, seed=2, configs=[dataclasses.replace(cfg, link_rate=GBIT)] + [cfg] * n)
    src = h.engines[0]
    hs = [src.send(h.addrs[i + 1], floats(100_000, i), now=h.now) for i in range(n)]
    hr = [h.engines[i + 1].post_receive([(h.addrs[0], 0, np.zeros(100_000, np.float32))], now=h.now)
          for i in range(n)]
    src.datagrams_to_send(h.now)
    paths = [src._paths[h.addrs[i + 1]] for i in range(n)]
    share = datagram_share(GBIT, n, MSS)
    assert all(p.egress_share == pytest.approx(share) for p in paths)
    assert sum(p.pacing_rate(h.now) for p in paths) <= GRANT_UTILIZATION * GBIT
    evs = h.wait([(0, x) for x in hs] + [(i + 1, x) for i, x in enumerate(hr)])
    assert all(e.error is None for e in evs)


def test_an_inbound_only_link_rate_grants_but_does_not_split_the_sends(floats):
    """``share_egress=False`` (only the inbound side runs at ``link_rate``: ltp-ps --inbound-rate, launch's lab): the
    endpoint's ACKs still grant, its own paths get no egress share."""
    n = 3
    cfg = Config()
    h = SimHarness(n_hosts=n + 1, seed=2,
                   configs=[dataclasses.replace(cfg, link_rate=GBIT, share_egress=False)] + [cfg] * n)
    src = h.engines[0]
    hs = [src.send(h.addrs[i + 1], floats(100_000, i), now=h.now) for i in range(n)]
    back = [h.engines[i + 1].send(h.addrs[0], floats(100_000, 10 + i), now=h.now, tag=1) for i in range(n)]
    hr = [h.engines[i + 1].post_receive([(h.addrs[0], 0, np.zeros(100_000, np.float32))], now=h.now)
          for i in range(n)]
    gather = src.post_receive([(h.addrs[i + 1], 1, np.zeros(100_000, np.float32)) for i in range(n)], now=h.now)
    evs = h.wait([(0, x) for x in hs] + [(0, gather)] + [(i + 1, x) for i, x in enumerate(hr)]
                 + [(i + 1, x) for i, x in enumerate(back)])
    assert all(e.error is None for e in evs)
    assert all(src._paths[h.addrs[i + 1]].egress_share is None for i in range(n))  # its sends: not split
    granted = [h.engines[i + 1]._paths[h.addrs[0]].grant for i in range(n)]
    assert all(g is not None and g > 0 for g in granted), granted  # its ACKs: granted


@pytest.mark.parametrize("n, rate, queue, loss", [(8, GBIT, 32_000, 0.01), (4, GBIT, 62_500, 0.0),
                                                   (16, GBIT, 32_000, 0.001), (12, GBIT / 10, 16_000, 0.0)])
def test_grants_stop_an_incast_from_overflowing_a_shallow_queue(floats, n, rate, queue, loss):
    """N senders of 1 MB into one link with a shallow queue: without grants their BBR probes overflow the
    queue (a fifth or more of the packets) and Early Close cuts a tenth or more of every gradient; with
    the receiver granting equal shares the queue drops almost nothing after the first round (which starts
    before any grant) and the gathers keep nearly everything, at about the line rate."""
    def run(link_rate):
        return [(t, d, float(np.mean([r.delivered_fraction for r in reps])))
                for reps, t, d, _ in _incast_rounds(floats, n=n, size=1_000_000, rate=rate, delay_s=0.0002,
                                                    queue_bytes=queue, rounds=4, loss=loss, link_rate=link_rate)]

    off, on = run(None), run(rate)
    assert np.mean([d for _, d, _ in off[1:]]) > 0.15, off
    for t, drops, delivered in on[1:]:
        assert drops < 0.01, on
        assert delivered > 0.97, on
        assert t < 1.2, on
    assert np.mean([x for _, _, x in on[1:]]) > np.mean([x for _, _, x in off[1:]]) + 0.03


def test_loopback_peers_take_no_grant_no_share_and_are_not_counted(floats):
    """A worker colocated with its PS shard reaches it over loopback: its datagrams never cross the link."""
    from ltp.engine import Engine
    from ltp.sim import SimNetwork

    net = SimNetwork(seed=4)
    rx, local, remote = ("127.0.0.1", 7447), ("127.0.0.1", 7448), ("10.0.0.3", 7447)
    engines = {rx: Engine(Config(link_rate=GBIT), rng=random.Random(1)),
               local: Engine(Config(link_rate=GBIT), rng=random.Random(2)),
               remote: Engine(Config(), rng=random.Random(3))}
    for a, e in engines.items():
        net.add_host(a, e)
    net.trace = []
    data = {a: floats(200_000, i) for i, a in enumerate((local, remote))}
    outs = {a: np.zeros_like(d) for a, d in data.items()}
    hr = engines[rx].post_receive([(a, 0, outs[a]) for a in (local, remote)], now=0.0)
    hs = {a: engines[a].send(rx, data[a], now=0.0) for a in (local, remote)}
    done = {}

    def finished():
        for a, e in engines.items():
            while (ev := e.next_event()) is not None:
                done[(a, ev.handle)] = ev
        return (rx, hr) in done and all((a, h) in done for a, h in hs.items())

    net.run(until=30.0, stop=finished)
    assert all(r.regime == "complete" for r in done[(rx, hr)].reports)
    assert all(np.array_equal(outs[a], data[a]) for a in data)
    grants = {a: [wire.ack_grant(d, wire.unpack_header(d)[1]) for _, s, dst, d in net.trace
                  if s == rx and dst == a and d[0] & 0x0F == wire.T_ACK] for a in (local, remote)}
    assert grants[local] and not any(grants[local])  # loopback: no grant
    full = datagram_share(GBIT, 1, MSS)  # the remote sender is the only one counted
    assert grants[remote] and all(g == pytest.approx(full, rel=2e-3) for g in grants[remote])
    assert engines[rx]._admission.link_peers == 0 and not engines[rx]._admission.per_peer  # all closed
    # the loopback sender's path takes no egress share from its own link either
    assert engines[local]._paths[rx].egress_share is None


@pytest.mark.parametrize("n, rate", [(4, GBIT / 100), (6, GBIT / 10)])
def test_the_first_gather_into_a_granted_link_is_not_cut_by_one_senders_view_of_it(floats, n, rate):
    """Round 0 has no LT history: the threshold comes from the paper's formula with the sender's BtlBw, which a
    sender measured with its first flight alone on the link (N times its share). The receiver knows the share it
    grants and caps the formula's BtlBw at it, so the first gather is not cut at a deadline N times too early
    (lab, ``ltp-ps launch --workers 4 --rate 10mbit``: round 0 was cut to 0.43-0.62 delivered, now whole)."""
    size = 150_000
    first = next(iter(_incast_rounds(floats, n=n, size=size, rate=rate, delay_s=0.0002, queue_bytes=64_000,
                                     rounds=1, link_rate=rate)))
    reps, t, _, _ = first
    assert min(r.delivered_fraction for r in reps) > 0.95, [(r.regime, round(r.delivered_fraction, 3)) for r in reps]
    assert t < 1.5, t


def test_a_batch_carries_its_paths_pacing_rate_unless_a_grant_paces_it():
    from ltp.engine import Engine
    from ltp.path import SegmentTransmit

    eng = Engine(Config(), rng=random.Random(1), gather_send=True)
    peer = ("10.0.0.2", 7447)
    eng.send(peer, np.zeros(2_000_000, np.float32), now=0.0)
    path = eng._paths[peer]

    def batches(now):
        return [t for t in eng.datagrams_to_send(now) if isinstance(t, SegmentTransmit)]

    txs = batches(0.0)
    assert txs and all(t.pace_rate == path.pacer.rate > 0 for t in txs)
    path.on_grant(2e7, now=0.01)
    txs = [t for now in (0.01, 0.02, 0.03) for t in (eng.handle_timer(now) or batches(now))]
    assert txs and all(t.pace_rate == 0.0 for t in txs)  # granted: 2-packet bursts already, no thread pacing
