"""The paper-scale fluid runner (tools/experiments/schedules_fluid.py) on small setups: plumbing and checks."""

import pytest

from ltp_tools.experiments import schedules_fluid as sf


def test_rat_rows_and_checks_small():
    over = sf.rat_oversubscription((1, 2, 8), hosts_per_rack=4, model_bytes=8e6)
    assert [r["oversubscription"] for r in over] == [1, 2, 8]
    assert all(r["hosts"] == 16 for r in over)
    # 2:1 slows the PS (by o w (1-1/r) / (w-1) = 1.6) but not RAT, whose uplinks carry 1.5 S < 2 S per host
    assert over[1]["ps_s"] == pytest.approx(1.6 * over[0]["ps_s"], rel=0.02)
    assert over[1]["rat_s"] == pytest.approx(over[0]["rat_s"], rel=0.02)
    # at 8:1 with only 4 hosts per rack RAT is uplink-bound too: 1.5 S / (B/2) = 3 S/B
    bound = 3 * 8e6 * 8 / 40e9
    assert bound * (1 - 1e-6) <= over[2]["rat_s"] <= 1.2 * bound
    fail = sf.rat_failures((0, 2), (0.005,), racks=(4, 4), model_bytes=8e6, seeds=(1, 2, 3), rat_chunks=1)
    assert [r["k"] for r in fail] == [0, 2]
    assert len(fail[1]["ring_runs"]) == 3 and fail[1]["ring_s"] == sorted(fail[1]["ring_runs"])[1]
    hop = sf.hoplite_section6(nodes=8, bcast_bytes=1e7, ps_bytes=2e6)
    assert [s["nodes"] for s in hop["sync_ps"]] == [8]
    assert hop["broadcast"]["direct_over_hoplite"] > 3
    checks = sf.checks(over, fail, hop)
    names = [c["check"] for c in checks]
    assert any("8:1" in n for n in names) and any("sync PS 8 nodes" in n for n in names)
    assert all(isinstance(c["passed"], bool) for c in checks)
    assert "Checks:" in sf.format_report({"rat_oversubscription": over, "rat_failures": fail, "hoplite": hop,
                                          "checks": checks})
