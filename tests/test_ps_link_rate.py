"""``--link-rate``: the PS's LTP endpoints grant workers equal shares of its link (ltp/link_share.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess

import numpy as np
import pytest

from ltp_ps.cli import COMMON, _passthrough, build_parser
from ltp_ps.transport import open_transport
from ps_helpers import child_env, lab_reason, ps_cmd

pytestmark = pytest.mark.timeout(170)


def test_link_rate_parses_units_reaches_every_role_and_refuses_nonsense(capsys):
    args = build_parser().parse_args(["launch", "--link-rate", "1gbit"])
    assert args.link_rate == 1e9
    assert _passthrough(args, COMMON)[_passthrough(args, COMMON).index("--link-rate") + 1] == "1000000000.0"
    assert build_parser().parse_args(["server", "--link-rate", "1000000000.0"]).link_rate == 1e9
    assert build_parser().parse_args(["worker"]).link_rate is None
    for bad in ("0", "-5", "fast"):
        with pytest.raises(SystemExit) as ei:
            build_parser().parse_args(["worker", "--link-rate", bad])
        assert ei.value.code == 2
        assert "e.g. 1gbit" in capsys.readouterr().err


def test_inbound_rate_parses_reaches_only_the_servers_and_configures_grants_without_an_egress_split():
    from ltp_ps.cli import SERVER, WORKER

    args = build_parser().parse_args(["launch", "--inbound-rate", "10mbit"])
    assert args.inbound_rate == 10e6
    assert "--inbound-rate" in _passthrough(args, SERVER) and "--inbound-rate" not in _passthrough(args, COMMON + WORKER)

    async def main():
        t = await open_transport("ltp", link_rate_bps=80e6, inbound_only=True, job_key=b"k")
        u = await open_transport("ltp", link_rate_bps=80e6, job_key=b"k")
        try:
            assert t._ep.config.link_rate == 10e6 and t._ep.config.share_egress is False
            assert u._ep.config.share_egress is True
        finally:
            await t.close()
            await u.close()

    asyncio.run(main())


def test_transports_told_their_link_rate_configure_ltp_and_leave_loopback_ungranted():
    async def main():
        ps = await open_transport("ltp", link_rate_bps=8e9, job_key=b"k")
        plain = await open_transport("ltp", job_key=b"k")
        workers = [await open_transport("ltp", job_key=b"k") for _ in range(3)]
        try:
            assert ps._ep.config.link_rate == 1e9 and plain._ep.config.link_rate is None
            grads = [np.full(300_000, i + 1, np.float32) for i in range(3)]
            bufs = [np.zeros(300_000, np.float32) for _ in range(3)]
            peers = [w.local_addr for w in workers]
            gathered = asyncio.ensure_future(ps.gather(peers, bufs, tag=1, timeout=20))
            await asyncio.gather(*(w.send(ps.local_addr, g, tag=1, timeout=20) for w, g in zip(workers, grads)))
            reps = await gathered
            assert all(r.delivered_fraction == 1.0 for r in reps)
            assert all(np.array_equal(b, g) for b, g in zip(bufs, grads))
            for w in workers:  # loopback never crosses the link: no grant (tests/test_link_share.py has the rest)
                assert w._ep.engine._paths[ps.local_addr].grant is None
        finally:
            for t in (ps, plain, *workers):
                await t.close()

    asyncio.run(main())


@pytest.mark.netns
@pytest.mark.slow
def test_launch_in_a_rate_limited_lossy_lab_with_the_link_rate_trains(tmp_path):
    reason = lab_reason()
    if reason:
        pytest.skip(reason)
    summary = tmp_path / "s.json"
    p = subprocess.run(ps_cmd("launch", "--workers", 5, "--epochs", 12, "--lab", "on", "--loss", 0.01,
                              "--rate", "200mbit", "--link-rate", "200mbit", "--transport", "ltp",
                              "--summary-json", summary),
                       env=child_env(), capture_output=True, text=True, timeout=160)
    assert p.returncode == 0, p.stdout + p.stderr
    s = json.loads(summary.read_text())
    assert s["final_accuracy"] >= 0.95, s
    assert s["delivered_mean"] >= 0.9, s


@pytest.mark.netns
@pytest.mark.slow
def test_launch_tells_each_ps_the_labs_inbound_rate_so_a_slow_link_keeps_the_gradients(tmp_path):
    """``--rate 10mbit`` without ``--link-rate``: four workers' gathers into the PS's 10 Mbit/s link.  Each worker's BBR
    estimated the link alone, the four overflowed its queue, and Early Close cut what they lost: the sweep measured
    delivered 0.52-0.56 at no loss, accuracy 0.86-0.88 against TCP's 0.92.  Launch now gives each PS the lab's
    inbound rate (``--inbound-rate``): grants keep the gathers whole, the broadcast is not throttled."""
    reason = lab_reason()
    if reason:
        pytest.skip(reason)
    summary = tmp_path / "s.json"
    p = subprocess.run(ps_cmd("launch", "--workers", 4, "--epochs", 6, "--lab", "on", "--rate", "10mbit",
                              "--transport", "ltp", "--summary-json", summary),
                       env=child_env(), capture_output=True, text=True, timeout=160)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "--inbound-rate" in p.stdout, p.stdout
    s = json.loads(summary.read_text())
    assert s["delivered_mean"] >= 0.95, s
    # it trained: what this test is about is the delivered fraction above. 6 epochs at 10 Mbit/s end at 0.79-0.93
    # whatever the transport, and the last epoch can fall 0.03-0.13 below the best (a CI run: best 0.917, final
    # 0.792, delivered 0.995), so the bound is on the best epoch, with a floor on the last one for a collapse
    assert s["best_accuracy"] >= 0.85 and s["final_accuracy"] >= 0.7, s
