"""The own-pause rule (ltp.liveness): a receiver whose process paused judges its senders by what they could send.

Engine tier, virtual clock: ``SimNetwork.stall`` stops a host as SIGSTOP or a loop blocked in one call would; its
arrivals wait and are read, then its late timer runs, when it resumes."""

from __future__ import annotations

import numpy as np
import pytest

from ltp.config import Config
from ltp.liveness import OWN_PAUSE_S, OWN_STALL_S, paused
from ltp import wire
from ltp.regimes import Regime

GBIT = 1e9 / 8
N = 2_000_000  # 8 MB of float32: 65 ms at 1 Gbit/s


def _warm_then_receive(h, floats, *, pause_host: int | None, pause_s: float, tag: int = 9):
    """Three loss-tolerant 8 MB messages 0 -> 1 teach the receiver's Early Close thresholds; a fourth is paused
    10 ms in (host ``pause_host`` stops for ``pause_s``). Returns the fourth's receive report."""
    data = floats(N)
    out = np.zeros_like(data)
    for k in range(3):
        hs = h.engines[0].send(h.addrs[1], data, now=h.now, tag=k)
        hr = h.engines[1].post_receive([(h.addrs[0], k, out)], now=h.now)
        h.wait([(0, hs), (1, hr)], timeout=20)
    hs = h.engines[0].send(h.addrs[1], data, now=h.now, tag=tag)
    hr = h.engines[1].post_receive([(h.addrs[0], tag, out)], now=h.now)
    h.net.run(until=h.now + 0.01)
    if pause_host is not None:
        h.net.stall(h.addrs[pause_host], pause_s)
    _, recv = h.wait([(0, hs), (1, hr)], timeout=20)
    assert recv.error is None, recv.error
    (rep,) = recv.reports
    if rep.regime == Regime.COMPLETE:
        assert np.array_equal(out, data)
    return rep


@pytest.mark.parametrize("pause_s", [0.05, 0.3, 0.9])
def test_a_receiver_that_paused_does_not_cut_its_senders(harness, floats, pause_s):
    """Before the rule, a receiver paused 0.3 s in a gather cut the message at about 14 %: its Early Close deadline
    passed while its senders waited for its ACKs, and it closed the flow with what its socket held."""
    h = harness(seed=61)
    h.links(rate=GBIT, delay_s=0.0005)
    rep = _warm_then_receive(h, floats, pause_host=1, pause_s=pause_s)
    rx = h.engines[1]
    assert rep.regime == Regime.COMPLETE and rep.delivered_fraction == 1.0, rep
    assert rx.stats.own_pauses == 1 and rx.stats.own_stalls == 0
    assert rep.duration_s >= pause_s  # the report still counts the wall time


def test_a_stall_of_the_receiver_moves_its_clocks_too(harness, floats):
    h = harness(seed=62, config=Config(peer_silence_min_s=8.0))  # the sender waits out the 3 s silence
    h.links(rate=GBIT, delay_s=0.0005)
    rep = _warm_then_receive(h, floats, pause_host=1, pause_s=3.0)
    rx = h.engines[1]
    assert rep.regime == Regime.COMPLETE and rep.delivered_fraction == 1.0, rep
    assert rx.stats.own_stalls == 1 and rx.stats.own_pauses == 1  # one pause, counted once
    assert 3.0 <= rep.duration_s < 3.5


def test_a_sender_that_paused_is_still_cut_by_the_receivers_deadline(harness, floats):
    """The rule is the receiver's own: a sender's pause is a straggler, and Early Close cuts it."""
    h = harness(seed=63)
    h.links(rate=GBIT, delay_s=0.0005)
    rep = _warm_then_receive(h, floats, pause_host=0, pause_s=0.3)
    assert rep.regime in (Regime.DEADLINE, Regime.EARLY) and rep.delivered_fraction < 0.5, rep
    assert h.engines[1].stats.own_pauses == 0
    assert rep.duration_s < 0.3


def test_a_lateness_within_the_scheduling_noise_is_no_pause(harness, floats):
    h = harness(seed=64)
    h.links(rate=GBIT, delay_s=0.0005)
    rep = _warm_then_receive(h, floats, pause_host=1, pause_s=OWN_PAUSE_S / 2)
    assert rep.regime == Regime.COMPLETE
    assert h.engines[1].stats.own_pauses == 0


def test_a_deadline_already_past_when_armed_counts_from_the_input_that_armed_it(harness, floats):
    """The engine measures lateness from its newest input as well as from its deadline: a deadline that was
    already past when get_timer gave it (overdue work) is due at that input, so reading more datagrams at one
    moment after a pause counts one pause, not one per datagram."""
    h = harness(seed=65)
    h.links(rate=GBIT, delay_s=0.0005)
    rx = h.engines[1]
    rx._due, rx._input_at = 10.0, 11.0
    rx._note_stall(11.005)
    assert rx.stats.own_pauses == 0 and rx.stats.own_stalls == 0


def test_paused_is_the_lateness_past_the_threshold():
    assert paused(None, 5.0) == 0.0
    assert paused(5.0, 5.0 + OWN_PAUSE_S / 2) == 0.0
    assert paused(5.0, 5.3) == pytest.approx(0.3)
    assert OWN_PAUSE_S < OWN_STALL_S


def test_acks_read_after_a_senders_pause_give_no_rtt_sample(harness, floats):
    """A sender paused 0.3 s right after its first flight reads that flight's ACKs on resume: they time the pause
    (the own-pause rule in ``Path.on_ack``), so its first RTT sample, and BBR's RTprop, come from the next flight."""
    h = harness(seed=66, config=Config(peer_silence_min_s=8.0))
    h.links(rate=GBIT, delay_s=0.001)
    a = h.engines[0]
    data = floats(N)
    hs = a.send(h.addrs[1], data, now=h.now, reliable=True)
    h.engines[1].post_receive([(h.addrs[0], 0, np.zeros_like(data))], now=h.now)
    h.net.run(until=h.now + 0.0005)  # the first flight is out; no ACK is back
    path = a._paths[h.addrs[1]]
    stopped = h.now
    h.net.stall(h.addrs[0], 0.3)
    h.net.run(until=stopped + 0.3 + 1e-6)  # the ACKs that waited are read
    assert a.stats.own_pauses == 1  # a sender: its dead-peer clock moved on, no receive to move
    assert path.srtt is None and path.bbr.rtprop is None
    (ev,) = h.wait([(0, hs)], timeout=5)
    assert ev.error is None, ev.error
    assert path.srtt < 0.01 and path.bbr.rtprop < 0.005


def test_a_message_that_registered_during_the_pause_counts_from_the_resume():
    """Its REG and first DATA waited in the socket while this process paused (their kernel timestamps fall in the
    pause): the flow was not open to be moved on, so its Early Close clock starts when the process resumed, not
    at the REG's arrival. (Read late without a pause, a busy loop, the arrival still counts:
    ``test_admission.test_a_registration_read_from_a_late_backlog_waits_for_its_data_behind_it``.)"""
    from test_admission import A, B, _deliver_late, datas, engines, out, regs

    a, b = engines()
    b.post_receive([(A, 1, np.zeros(50_000, np.float32))], now=1.0)
    a.send(B, np.arange(50_000, dtype=np.float32), now=1.0, tag=1)
    dg = out(a, 1.0)
    b._due = 1.01  # the timer the paused process did not run
    arrived, resumed = 1.001, 1.3
    _deliver_late(b, regs(dg) + datas(dg)[:4], A, arrived, resumed)
    assert b.stats.own_pauses == 0  # no receive was open when the pause was noticed
    (flow,) = b._rx.values()
    assert flow.start == pytest.approx(resumed)
    assert flow.anchor == pytest.approx(resumed)  # the receive group's clock too


def test_an_unanswered_registration_is_repeated_several_times_within_the_dead_peer_limit(harness, floats):
    """The registration's back-off doubled up to 1 s, the dead-peer limit itself: after rounds at 0.25 and 0.5 s
    the next was due at 1 s, so a receiver that missed the early rounds (a process paused 0.3 s behind a full
    socket) had no chance to answer before the sender judged it dead, and a live peer failed a send with
    "registration unanswered" (found pausing a gathering process 0.3 s at random). Rounds are now at most a
    quarter of that limit apart (``liveness.reg_gap_max``). Here every answer is lost, so the rounds show."""
    h = harness(seed=67, config=Config(peer_silence_min_s=1.0))
    h.links(rate=GBIT, delay_s=0.0005)
    a, b = h.engines
    h.link(1, 0, rate=GBIT, delay_s=0.0005, loss=1.0, loss_min_size=0)
    h.net.trace = []
    t0 = h.now
    hs = a.send(h.addrs[1], floats(1000), now=h.now, reliable=True)
    (ev,) = h.wait([(0, hs)], timeout=5)
    assert ev.error is not None  # nothing was heard: dead after the limit
    rounds = sorted({round(t - t0, 4) for (t, src, dst, d) in h.net.trace if d[0] == (wire.VERSION << 4 | wire.T_REG)})
    gaps = [q - p for p, q in zip(rounds, rounds[1:])]
    assert rounds[-1] > 0.7 and max(gaps) <= 0.25 + 0.002, rounds


def test_registration_rounds_are_at_most_a_quarter_of_the_dead_peer_limit_apart():
    from ltp.liveness import REG_ROUNDS_PER_SILENCE, reg_gap_max, silence_limit

    cfg = Config(peer_silence_min_s=1.0, idle_timeout_s=30.0)
    for srtt in (None, 0.0001, 0.05):
        assert reg_gap_max(cfg, srtt) == pytest.approx(silence_limit(cfg, srtt) / REG_ROUNDS_PER_SILENCE)
    assert reg_gap_max(cfg, None) == pytest.approx(0.25)
