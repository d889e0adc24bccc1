"""ltp.admission.Admission on its own: caps, memory accounting and the answers to late DATA/REGs."""

from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ltp import wire
from ltp.admission import LAPSED_TTL_S, STOP_REPEAT_S, UNREGISTERED_RESETS_PER_S, Admission
from ltp.config import REG_COPIES_MAX, Config
from ltp.engine import Engine
from ltp.regimes import CloseReason
from ltp.reports import EndpointStats

A = ("10.0.0.1", 7447)
B = ("10.0.0.2", 7447)


def _admission(**cfg):
    ctrl = deque()
    return Admission(Config(**cfg), EndpointStats(), ctrl), ctrl


def _reg(tag=5, n=1000, seed=1):
    """One REG datagram from A (made by a real sender) and its header fields."""
    eng = Engine(Config(), rng=random.Random(seed), local_addr=A)
    eng.send(B, np.zeros(n, np.float32), now=0.0, tag=tag)
    tx = eng.datagrams_to_send(0.0)[0]
    data = memoryview(bytes(tx.data[:tx.nbytes]))
    ptype, flags, fid, token, _w2, w3 = wire.unpack_header(data)
    assert ptype == wire.T_REG
    return data, flags, fid, token, w3


def _types(ctrl):
    return [wire.unpack_header(d)[0] for d, _ in ctrl]


def test_reg_becomes_pending_counted_and_acked_and_expires():
    adm, ctrl = _admission()
    data, flags, fid, token, w3 = _reg()
    assert adm.on_reg(data, A, flags, fid, token, w3, 0.0, 0.0) is None
    assert list(adm.pending) == [(A, fid)] and adm.per_peer == {A: 1} and adm.per_host == {A[0]: 1}
    assert _types(ctrl) == [] and adm.memory == 0  # nothing committed on a REG
    # its answer is held for company until ack_delay_s after the REG (ltp/admission.py)
    hold = adm.config.ack_delay_s
    assert adm.next_answer_due() == pytest.approx(hold)
    assert adm.release_answers(hold / 2) == 0 and _types(ctrl) == []
    assert adm.release_answers(hold) == 1 and _types(ctrl) == [wire.T_ACK] and adm.next_answer_due() is None
    assert adm.pending_for((A, fid), token) is not None and adm.pending_for((A, fid), token ^ 1) is None
    expiry = adm.expiries.next_time()
    adm.expire_pending(expiry - 1e-6)
    assert adm.pending
    adm.expire_pending(expiry)
    assert not adm.pending and adm.per_peer == {} and adm.per_host == {}
    assert adm.stats.dropped == {"registration_expired": 1}


def test_commit_takes_memory_within_caps_and_release_gives_it_back():
    adm, ctrl = _admission(max_receive_memory=10_000)
    data, flags, fid, token, w3 = _reg(n=1000)  # 4000 bytes, 3 segments
    adm.on_reg(data, A, flags, fid, token, w3, 0.0, 0.0)
    pend = adm.pending[(A, fid)]
    need = adm.commit(pend, None, 0.001)  # no slot: bitmap + internal buffer
    assert need == pend.seg_count + 4000 and adm.memory == need and adm.host_memory == {A[0]: need}
    assert not adm.pending and adm.per_peer == {A: 1}  # still counted: the flow is open now
    assert not adm.fits(A[0], 10_000 - need + 1) and adm.fits(A[0], 10_000 - need)
    adm.release(A, need)
    adm.uncount(A)
    assert adm.memory == 0 and adm.host_memory == {} and adm.per_peer == {}


def test_commit_refuses_what_does_not_fit_and_remembers_the_flow_as_cancelled():
    adm, ctrl = _admission(max_receive_memory=3000)
    data, flags, fid, token, w3 = _reg(n=1000)
    adm.on_reg(data, A, flags, fid, token, w3, 0.0, 0.0)
    assert adm.stats.refused == {"out_of_memory": 1}  # said early, on the REG
    adm2, ctrl2 = _admission(max_receive_memory=5000)
    adm2.on_reg(data, A, flags, fid, token, w3, 0.0, 0.0)
    adm2.take(B, 2000)  # someone else took memory meanwhile
    assert adm2.commit(adm2.pending[(A, fid)], None, 0.001) is None
    assert adm2.stats.refused == {"out_of_memory": 1} and adm2.per_peer == {}
    assert adm2.closed[(A, fid)][:2] == [token, wire.STOP_CODES[CloseReason.CANCELLED]]


def test_late_data_of_a_closed_flow_gets_its_stop_again_at_most_once_per_interval():
    adm, ctrl = _admission()
    adm.remember_closed((A, 9), 77, wire.STOP_CODES[CloseReason.EARLY], 12, now=0.0)
    for t in (0.0, 0.0001, STOP_REPEAT_S, STOP_REPEAT_S * 1.5, STOP_REPEAT_S * 2.01):
        adm.on_unknown_data((A, 9), 77, t, open_flow=False)
    assert _types(ctrl) == [wire.T_STOP] * 3 and adm.stats.dropped == {"closed_flow": 5}
    _, _, fid, token, count, w3 = wire.unpack_header(ctrl[0][0])
    assert (fid, token, count, w3 >> 24) == (9, 77, 12, wire.STOP_CODES[CloseReason.EARLY])
    adm.on_unknown_data((A, 9), 78, 1.0, open_flow=False)  # another token: not ours
    assert adm.stats.dropped["bad_token"] == 1
    adm.purge(adm.config.closed_flow_ttl_s)
    assert not adm.closed


def test_unknown_data_reset_is_rate_limited():
    adm, ctrl = _admission()
    n = int(UNREGISTERED_RESETS_PER_S) + 500
    for i in range(n):
        adm.on_unknown_data((A, i % 65536), 1, 0.0, open_flow=False)
    assert len(ctrl) == int(UNREGISTERED_RESETS_PER_S) and adm.stats.dropped == {"unknown_flow": n}
    adm.on_unknown_data((A, 1), 1, 0.01, open_flow=False)  # 10 ms refill 10 answers
    assert len(ctrl) == int(UNREGISTERED_RESETS_PER_S) + 1
    code = wire.unpack_header(ctrl[-1][0])[4]
    assert wire.RESET_REASONS[code] == "unregistered"


def test_reg_for_an_expired_tag_is_stopped_with_deadline():
    adm, ctrl = _admission()
    adm.expire_tag(A, 5, now=0.0)
    data, flags, fid, token, w3 = _reg(tag=5)
    adm.on_reg(data, A, flags, fid, token, w3, 0.001, 0.0)
    assert not adm.pending and _types(ctrl) == [wire.T_STOP]
    assert ctrl[0][0][12] == wire.STOP_CODES[CloseReason.DEADLINE]
    assert adm.closed[(A, fid)][1] == wire.STOP_CODES[CloseReason.DEADLINE]
    adm.purge(adm.config.closed_flow_ttl_s)
    assert not adm.expired_tags


@pytest.mark.parametrize("cap", [1, 2, 3])
def test_per_address_cap_refuses_with_reset(cap):
    adm, ctrl = _admission(max_flows_per_peer=cap)
    for seed in range(cap + 2):
        data, flags, fid, token, w3 = _reg(seed=seed)
        adm.on_reg(data, A, flags, fid, token, w3, 0.0, 0.0)
    assert len(adm.pending) == cap and adm.stats.refused == {"too_many_flows": 2}
    assert _types(ctrl).count(wire.T_RESET) == 2


def _lapsed(adm, tag=5):
    """A REG from A admitted by ``adm`` and expired unfilled: ``(fid, token, expiry)`` of its lapsed registration."""
    data, flags, fid, token, w3 = _reg(tag=tag)
    adm.on_reg(data, A, flags, fid, token, w3, 0.0, 0.0)
    expiry = adm.expiries.next_time()
    adm.expire_pending(expiry)
    return fid, token, expiry


def test_a_lapsed_registration_is_revived_once_with_its_token_and_counted_again():
    adm, _ = _admission()
    fid, token, expiry = _lapsed(adm)
    assert list(adm.lapsed) == [(A, fid)] and adm.per_peer == {}  # lapsed: counted against no cap
    assert adm.revive((A, fid), token ^ 1, expiry) is None and adm.lapsed  # another token: kept, not revived
    pend = adm.revive((A, fid), token, expiry + LAPSED_TTL_S / 2)
    assert pend is not None and adm.pending == {(A, fid): pend} and adm.per_peer == {A: 1}
    assert not adm.lapsed and adm.stats.revived_registrations == 1
    assert adm.revive((A, fid), token, expiry + LAPSED_TTL_S / 2) is None  # once
    assert adm.commit(pend, None, expiry) is not None and not adm.pending


def test_a_lapsed_registration_is_not_revived_past_its_ttl():
    adm, _ = _admission()
    fid, token, expiry = _lapsed(adm)
    assert adm.revive((A, fid), token, expiry + LAPSED_TTL_S + 1e-6) is None
    assert not adm.pending and adm.per_peer == {} and adm.stats.revived_registrations == 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["reg", "expire", "revive", "forge", "commit", "purge"]),
                          st.integers(0, 2), st.floats(0.0, 3.0)), min_size=1, max_size=40),
       st.integers(1, 3), st.integers(1, 4))
def test_pending_and_lapsed_registrations_keep_the_caps_whatever_the_order(ops, per_peer, pending_cap):
    """Registrations from three sources, expiring, revived by their DATA (or a forgery), committed and purged in
    any order: the per-address counts are exactly the pending plus committed flows, no source exceeds its cap,
    no registration is both pending and lapsed, and at most ``max_pending_registrations`` are kept lapsed."""
    adm, _ = _admission(max_flows_per_peer=per_peer, max_pending_registrations=pending_cap)
    regs: dict = {}  # source -> [(fid, token), ...] of every message it registered
    made = 0
    committed: dict = {}
    now = 0.0
    for op, who, dt in ops:
        now += dt
        src = ("10.0.0.1", 1000 + who)
        if op == "reg":
            made += 1
            data, flags, fid, token, w3 = _reg(seed=made)
            regs.setdefault(who, []).append((fid, token))
            adm.on_reg(data, src, flags, fid, token, w3, now, 0.0)
        elif op == "expire":
            adm.expire_pending(now)
        elif op in ("revive", "forge") and who in regs:
            fid, token = regs[who][int(dt * 7) % len(regs[who])]
            pend = adm.revive((src, fid), token if op == "revive" else token ^ 0x5A5A, now)
            if pend is not None:
                assert op == "revive" and pend.token == token
                if adm.commit(pend, None, now) is not None:
                    committed[src] = committed.get(src, 0) + 1
        elif op == "commit" and who in regs:
            fid, token = regs[who][int(dt * 7) % len(regs[who])]
            pend = adm.pending_for((src, fid), token)
            if pend is not None and adm.commit(pend, None, now) is not None:
                committed[src] = committed.get(src, 0) + 1
        elif op == "purge":
            adm.purge(now)
        counts: dict = dict(committed)
        for p in adm.pending.values():
            counts[p.peer] = counts.get(p.peer, 0) + 1
        assert adm.per_peer == counts
        assert all(n <= per_peer for n in adm.per_peer.values())
        assert not set(adm.pending) & set(adm.lapsed) and len(adm.lapsed) <= pending_cap


def test_a_lapsed_registration_for_a_receive_that_expired_meanwhile_is_not_revived():
    adm, _ = _admission()
    fid, token, expiry = _lapsed(adm, tag=5)
    adm.expire_tag(A, 5, expiry)  # the receive for (A, 5) passed its deadline
    assert adm.revive((A, fid), token, expiry + 0.01) is None and not adm.pending and not adm.lapsed


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.floats(0.0, 0.002)), max_size=12),
       st.sets(st.integers(0, 3)), st.floats(0.0, 0.003))
def test_held_answers_go_when_due_or_with_company_and_nothing_is_lost(answers, company, now):
    """``release_answers``: a held REG answer moves to the control queue when due or when an ACK with entries or a
    STOP of its flow is there (to be folded); every other one stays held, in order; none is dropped or doubled."""
    adm, ctrl = _admission()
    for fid in sorted(company):
        ctrl.append((wire.pack_header(wire.T_STOP, 0, fid, 7, 0, wire.STOP_CODES["complete"] << 24), A))
    before = len(ctrl)
    held = [(due, wire.pack_ack(fid, 7, 0, 0, (), 0), A) for fid, due in answers]
    adm.held = list(held)
    moved = adm.release_answers(now)
    out = [d for d, _ in list(ctrl)[before:]]
    want_out = [ack for due, ack, _ in held if due <= now or wire.unpack_header(ack)[2] in company]
    want_kept = [h for h in held if not (h[0] <= now or wire.unpack_header(h[1])[2] in company)]
    assert out == want_out and moved == len(want_out) and adm.held == want_kept
    assert adm.next_answer_due() == (min(h[0] for h in want_kept) if want_kept else None)
    adm.release_answers(now, everything=True)
    assert adm.held == [] and len(ctrl) == before + len(held)


def test_a_flood_of_regs_holds_at_most_held_max_answers_and_answers_the_rest_at_once():
    """A peer that repeats one REG (no job key, so no replay cache) is answered every time, as before; past
    ``held_max`` held answers the rest go at once instead of growing the list."""
    adm, ctrl = _admission(max_pending_registrations=4)
    assert adm.held_max == 4 * REG_COPIES_MAX
    data, flags, fid, token, w3 = _reg()
    for _ in range(3 * adm.held_max):
        adm.on_reg(data, A, flags, fid, token, w3, 0.0, 0.0)
    assert len(adm.held) == adm.held_max and len(ctrl) == 2 * adm.held_max
    assert _types(ctrl) == [wire.T_ACK] * len(ctrl) and adm.stats.reg_repeats == 3 * adm.held_max - 1
