"""``python -m ltp_tools.sim_transfer``: one reliable transfer through ltp.sim's emulated link (no CPU cost)."""

from __future__ import annotations

import json

import pytest

from ltp_tools import sim_transfer


def test_a_short_path_runs_at_the_links_ceiling_and_never_above_it():
    res = sim_transfer.run(size=5_000_000, rate_bps=1e9, loss=0.0)
    # the ceiling: every packet once at the link's packet rate, the frames counted as the lab's tbf counts them
    packets = -(-5_000_000 // 1456)
    assert res["ceiling_gbps"] == pytest.approx(5e6 * 8 / (packets * 1514 / 125e6) / 1e9, rel=1e-3)
    assert 0.85 * res["ceiling_gbps"] < res["goodput_gbps"] <= 1.001 * res["ceiling_gbps"]
    assert res["queue_drops"] == res["random_drops"] == res["retransmitted"] == 0
    assert res["packets_sent"] == packets


@pytest.mark.parametrize("size", [1, 1457, 100_000])
def test_no_message_beats_the_ceiling_whatever_its_last_packet(size):
    # the ceiling counts the bytes the link carries: a short last packet is short (a 1-byte message read 7 x
    # its ceiling while the ceiling counted every packet full-size)
    res = sim_transfer.run(size=size, rate_bps=1e9, delay_s=0.0005)
    assert 0 < res["goodput_gbps"] <= 1.001 * res["ceiling_gbps"]


def test_random_loss_is_resent_and_a_long_path_pays_its_start_up():
    short = sim_transfer.run(size=12_000_000, rate_bps=1e9, loss=0.02, seed=3)
    assert short["random_drops"] > 0 and short["retransmitted"] >= short["random_drops"]
    far = sim_transfer.run(size=12_000_000, rate_bps=1e9, delay_s=0.01, loss=0.02, seed=3)
    # 20 ms round trips: a 12 MB message ends inside STARTUP's ramp, at well under the short path's goodput
    assert far["goodput_gbps"] < 0.6 * short["goodput_gbps"]
    assert [row["state"] for row in far["trace"]][1:] == ["startup"] * (len(far["trace"]) - 1)
    ts = [row["t"] for row in far["trace"]]
    assert ts == sorted(ts) and all(b - a >= 0.02 for a, b in zip(ts, ts[1:]))
    assert far["trace"][-1]["t"] <= far["duration_s"] + 0.02


def test_the_same_seed_gives_the_same_run():
    a = sim_transfer.run(size=1_000_000, rate_bps=5e8, delay_s=0.002, loss=0.05, seed=7)
    b = sim_transfer.run(size=1_000_000, rate_bps=5e8, delay_s=0.002, loss=0.05, seed=7)
    assert a == b


@pytest.mark.parametrize("kw", [dict(size=0), dict(rate_bps=0.0), dict(delay_s=-1.0), dict(loss=1.0),
                                dict(interval_s=0.0)])
def test_misuse_is_refused(kw):
    args = dict(size=1000, rate_bps=1e9) | kw
    with pytest.raises(ValueError):
        sim_transfer.run(**args)


def test_the_command_prints_one_json_result_and_refuses_an_unlimited_link(capsys):
    assert sim_transfer.main(["--size", "500k", "--rate", "200mbit", "--delay", "1ms", "--loss", "0.01"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    res = json.loads(lines[-1])
    assert len(lines) == 1 and res["size_bytes"] == 500_000 and res["delay_s"] == pytest.approx(0.001)
    with pytest.raises(SystemExit):
        sim_transfer.main(["--rate", "none"])
