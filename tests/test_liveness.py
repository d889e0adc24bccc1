"""ltp.liveness: the dead-peer limit and the wording of silence errors (pure functions)."""

from __future__ import annotations

import pytest

from ltp.config import Config
from ltp.liveness import IDLE_SCAN_FRACTION, PEER_SILENCE_RTTS, idle_cause, next_idle_scan, silence_limit, silence_message


@pytest.mark.parametrize("srtt,expect", [(None, 1.0), (0.0, 1.0), (0.001, 1.0), (0.05, 0.05 * PEER_SILENCE_RTTS),
                                         (10.0, 30.0)])
def test_silence_limit_is_rtts_floored_and_capped(srtt, expect):
    cfg = Config(peer_silence_min_s=1.0, idle_timeout_s=30.0)
    assert silence_limit(cfg, srtt) == pytest.approx(expect)


def test_messages_name_the_peer_the_times_and_the_progress():
    cfg = Config(peer_silence_min_s=1.0, idle_timeout_s=30.0)
    msg = silence_message(cfg, peer=("10.0.0.2", 7), srtt_s=None, silent_s=1.25, limit_s=1.0, ran_s=3.5,
                          progress="registration unanswered")
    for part in ("('10.0.0.2', 7)", "1.250 s", "RTT not measured", "= 1.000 s", "ran 3.500 s",
                 "registration unanswered", "64 x RTT"):
        assert part in msg
    assert "RTT 2.50 ms" in silence_message(cfg, peer="p", srtt_s=0.0025, silent_s=2, limit_s=1, ran_s=2,
                                            progress="")
    cause = idle_cause("p", silent_s=31.0, idle_timeout_s=30.0, received=5, seg_count=9, ran_s=40.0)
    assert "31.000 s" in cause and "idle_timeout_s=30.0 s" in cause and "5/9 segments" in cause


@pytest.mark.parametrize("idle", [0.2, 30.0])
def test_the_idle_scan_runs_a_fraction_of_the_idle_timeout_apart(idle):
    cfg = Config(idle_timeout_s=idle)
    assert next_idle_scan(cfg, 100.0) == pytest.approx(100.0 + idle * IDLE_SCAN_FRACTION)
    assert 0 < IDLE_SCAN_FRACTION < 1  # a silent sender is found within (1 + fraction) x idle_timeout_s
