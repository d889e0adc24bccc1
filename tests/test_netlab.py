"""Network lab: topology, impairment accuracy (loss, rate, delay), offload checks, cleanup.

Each test builds its own small lab (~0.2 s) with a unique prefix, so tests never touch labs
of other runs. Skipped only when the machine cannot create namespaces (check_support()).
"""
import secrets
import signal
import statistics
import subprocess
import sys
import textwrap
import time

import pytest

from ltp_tools.netlab import Lab, check_support, clean, list_netns
from ltp_tools.netlab.measure import ping, udp_blast

_problem = check_support()
pytestmark = [pytest.mark.skipif(_problem is not None, reason=f"network lab unavailable: {_problem}"),
              pytest.mark.timeout(90)]


def _prefix():
    return f"ltplabt-{secrets.token_hex(3)}"


@pytest.fixture
def lab():
    with Lab(n_hosts=3, prefix=_prefix()) as lab:
        yield lab
    assert list_netns(lab.prefix + "-") == []


def _median_rtt_ms(lab, src, dst, count=10, size=1000):
    r = ping(lab, src, dst, count=count, interval_s=0.02, size=size)
    assert r["received"] == count, r
    return statistics.median(r["rtts_s"]) * 1e3, r["rtts_s"]


def test_topology_addresses_and_ping(lab):
    assert [h.name for h in lab.hosts] == ["h0", "h1", "h2"]
    assert [h.addr for h in lab.hosts] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
    assert set(list_netns(lab.prefix + "-")) == {lab.switch_ns} | {h.netns for h in lab.hosts}
    for h in lab.hosts:
        out = lab.run(h, ["ip", "-4", "-o", "addr", "show", "dev", h.ifname], capture_output=True, text=True).stdout
        assert f"{h.addr}/24" in out
    for a in lab.hosts:
        for b in lab.hosts:
            if a is not b:
                r = ping(lab, a, b, count=2, interval_s=0.01)
                assert r["received"] == 2, (a.name, b.name, r)


def test_offloads_are_off_on_every_lab_veth(lab):
    for ns, ifname in [(h.netns, h.ifname) for h in lab.hosts] + [(lab.switch_ns, h.port) for h in lab.hosts]:
        out = subprocess.run(["ip", "netns", "exec", ns, "ethtool", "-k", ifname], capture_output=True,
                             text=True, check=True).stdout
        feats = dict(line.strip().split(": ", 1)[:2] for line in out.splitlines()[1:] if ": " in line)
        for f in ("tcp-segmentation-offload", "generic-segmentation-offload", "generic-receive-offload",
                  "tx-udp-segmentation", "rx-gro-list", "rx-udp-gro-forwarding"):
            assert feats[f].startswith("off"), (ns, ifname, f, feats[f])


def test_loss_matches_request(lab):
    h0, h1, _ = lab.hosts
    lab.impair(h0, "ingress", loss=0.05)
    udp_blast(lab, h1, h0, count=20000, size=1000)
    st = lab.loss_stats(h0)
    assert st["seen"] == 20000, st   # every datagram crossed the loss point, nothing else did
    assert st["oversize"] == 0
    assert st["requested_loss"] == 0.05
    assert abs(st["measured_loss"] - 0.05) < 0.01, st


def test_default_loss_spares_small_packets_all_sizes_does_not(lab):
    h0, h1, _ = lab.hosts
    lab.impair(h0, loss=1.0)
    assert ping(lab, h1, h0, count=3, interval_s=0.01, size=100, timeout_s=0.5)["received"] == 3   # IP len 128
    assert ping(lab, h1, h0, count=3, interval_s=0.01, size=1000, timeout_s=0.5)["received"] == 0  # dropped
    lab.impair(h0, loss=1.0, all_sizes=True)
    assert ping(lab, h1, h0, count=3, interval_s=0.01, size=100, timeout_s=0.5)["received"] == 0
    st = lab.loss_stats(h0)
    # every IPv4 packet is dropped: the three echo requests, and any multicast the bridge floods meanwhile
    # (an IGMP membership report made one CI run count 4)
    assert st["dropped"] == st["seen"] >= 3, st
    lab.clear(h0)
    assert ping(lab, h1, h0, count=3, interval_s=0.01, size=1000)["received"] == 3
    assert lab.loss_stats(h0)["dropped"] == 0


def test_egress_loss_is_measured_at_the_switch(lab):
    h0, h1, _ = lab.hosts
    lab.impair(h1, "egress", loss=0.2)
    udp_blast(lab, h1, h0, count=5000, size=500)
    eg = lab.loss_stats(h1, "egress")
    assert eg["seen"] == 5000 and abs(eg["measured_loss"] - 0.2) < 0.03, eg
    assert lab.loss_stats(h0, "ingress")["seen"] == 5000 - eg["dropped"]


def test_oversize_counter_detects_gso_packets(lab):
    """With offloads off no packet exceeds the MTU; turning TSO/GSO back on must show up."""
    from ltp_tools.tcpbench import run_tcp_transfer

    h0, h1, _ = lab.hosts
    run_tcp_transfer(lab, h1, h0, 50_000_000, "cubic", timeout_s=30)
    assert lab.loss_stats(h0)["oversize"] == 0
    assert lab.loss_stats(h1, "egress")["oversize"] == 0
    assert lab.loss_stats(h1, "egress")["seen"] > 30000
    lab.run(h1, ["ethtool", "-K", h1.ifname, "tso", "on", "gso", "on"], check=True, capture_output=True)
    run_tcp_transfer(lab, h1, h0, 50_000_000, "cubic", timeout_s=30)
    assert lab.loss_stats(h1, "egress")["oversize"] > 0   # veth passes super-packets to the switch
    assert lab.loss_stats(h0)["oversize"] == 0            # the switch port (offloads off) segments them


@pytest.mark.parametrize("direction,rate", [("ingress", 200e6), ("egress", 100e6)])
def test_rate_limit(lab, direction, rate):
    from ltp_tools.tcpbench import run_tcp_transfer

    h0, h1, _ = lab.hosts
    target = h0 if direction == "ingress" else h1
    lab.impair(target, direction, rate_bps=rate)
    # goodput counts TCP payload; tbf counts Ethernet frames: 1448/1514 = 0.956 of the rate.
    # The limit must never be exceeded; reaching it can fail on a CPU-starved runner (a CI run on a 2-core VM saw
    # three transfers in a row at 0.79 of the rate while the same lab gave 0.92-0.95 alone), so the best of up
    # to five transfers must come within 10 %.
    best = 0.0
    for _ in range(5):
        r = run_tcp_transfer(lab, h1, h0, int(rate / 8 * 1.2), "cubic", timeout_s=30)
        got = r["goodput_gbps"] * 1e9
        assert got <= 1.0 * rate, (got, rate)
        best = max(best, got)
        if best > 0.9 * rate:
            break
    assert 0.90 * rate < best, (best, rate)


def test_a_shallow_egress_queue_takes_gso_batches_frame_by_frame(lab):
    """A rate limit on a host's own interface sees UDP-GSO batches and TCP super-packets before they are cut into
    frames.  tbf queues whole any packet no larger than its bucket, so with the 64 kB bucket over the incast row's
    32 kB queue every batch in between was dropped entire (session 42): LTP got 50 of 119,712 packets out and
    failed, kernel bbr crawled at 8-15 Mbit/s.  The lab's one-frame peak bucket makes tbf segment every batch."""
    from ltp_tools.bench import run_bench
    from ltp_tools.netlab import support
    from ltp_tools.tcpbench import run_tcp_transfer

    h0, h1, _ = lab.hosts
    rate = 200e6
    lab.impair(h0, "egress", rate_bps=rate, queue_bytes=32_000)
    qd = support._ns_exec(h0.netns, ["tc", "qdisc", "show", "dev", h0.ifname]).stdout
    assert "tbf" in qd and "peakrate" in qd, qd
    best = 0.0
    for _ in range(3):  # cubic through it: the best of three within 20 % of the rate (a busy 2-core runner)
        best = max(best, run_tcp_transfer(lab, h0, h1, 3_000_000, "cubic", timeout_s=30)["goodput_gbps"] * 1e9)
        if best > 0.8 * rate:
            break
    assert 0.8 * rate < best <= rate, (best, rate)
    r = run_bench(  # h0 sends to h1; run_bench sets only h1's ingress (nothing here), so h0's egress stays
        transport="ltp", size=3_000_000, lab=lab, timeout=30)
    assert r["delivered_fraction"] == 1.0 and r["verified"] and "error" not in r, r
    assert r["goodput_gbps"] * 1e9 <= rate, r


def test_delay_and_jitter(lab):
    h0, h1, _ = lab.hosts
    base, _ = _median_rtt_ms(lab, h1, h0)
    assert base < 2.0
    lab.impair(h0, "ingress", delay_s=0.010)
    rtt, _ = _median_rtt_ms(lab, h1, h0)
    assert 10.0 <= rtt < 13.0, rtt               # quiet machine: ~10.3-10.5 ms
    delayer = lab._delayers[(h0.index, "ingress")]
    lab.impair(h0, "ingress", delay_s=0.010, rate_bps=500e6)   # a rate change keeps the delayer
    assert lab._delayers[(h0.index, "ingress")] is delayer and delayer.poll() is None
    rtt, _ = _median_rtt_ms(lab, h1, h0)
    assert 10.0 <= rtt < 13.0, rtt
    lab.impair(h0, "egress", delay_s=0.005)       # replies out of h0 now wait 5 ms as well
    rtt, _ = _median_rtt_ms(lab, h1, h0)
    assert 15.0 <= rtt < 18.5, rtt
    lab.impair(h0, "egress")
    lab.impair(h0, "ingress", delay_s=0.010, jitter_s=0.004)
    _, rtts = _median_rtt_ms(lab, h1, h0, count=30)
    ms = [x * 1e3 for x in rtts]
    assert min(ms) >= 6.0, ms                     # never less than delay - jitter
    assert statistics.median(ms) < 13.0, ms
    assert statistics.pstdev(ms) > 1.0, ms        # uniform +-4 ms: stdev ~2.3 ms
    lab.clear(h0)
    rtt, _ = _median_rtt_ms(lab, h1, h0)
    assert rtt < 2.0


def test_delayer_keeps_up_with_1gbps(lab):
    """1 Gbit/s downlink + 10 ms one-way delay: BBR must fill most of the link and lose nothing."""
    from ltp_tools.tcpbench import run_tcp_transfer

    h0, h1, _ = lab.hosts
    lab.impair(h0, "ingress", rate_bps=1e9, queue_bytes=4_000_000, delay_s=0.010)
    best = 0.0
    # quiet 2-core machine: ~0.89 Gbit/s (1448/1514 of 1 Gbit/s = 0.956 is the ceiling);
    # other load on the cores costs BBR's startup, hence best of five and a loose bound (a CI run on a slow
    # machine: best of three 0.27, where the same machine gave 0.80-0.88 five times in a row when idle)
    for _ in range(5):
        r = run_tcp_transfer(lab, h1, h0, 120_000_000, "bbr", timeout_s=30)
        ds = lab.delayer_stats(h0)
        assert ds["queue_dropped"] == 0 and ds["user_dropped"] == 0, ds   # the delayer kept up
        assert r["rtt_us"] > 10_000, r
        best = max(best, r["goodput_gbps"])
        if best > 0.5:
            break
    assert best > 0.5, r


_STAMP_RX = textwrap.dedent("""
    import json, socket, struct, time
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, 35, 1)  # SO_TIMESTAMPNS
    s.bind(("0.0.0.0", 9999)); s.settimeout(10)
    print("ready", flush=True)
    out = []
    for _ in range(10):
        data, anc, _, _ = s.recvmsg(2048, 1024)
        now = time.time()
        stamp = [struct.unpack("qq", d[:16]) for lvl, typ, d in anc if typ == 35][0]
        sent = float(data.split()[0])
        out.append((stamp[0] + stamp[1] / 1e9 - sent, now - sent))
    print(json.dumps(out))
""")
_STAMP_TX = textwrap.dedent("""
    import socket, sys, time
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for _ in range(10):
        s.sendto(("%r " % time.time() + "x" * 1000).encode(), (sys.argv[1], 9999)); time.sleep(0.01)
""")


@pytest.mark.parametrize("direction", ["ingress", "egress"])
def test_kernel_receive_timestamps_include_the_delay(direction):
    """A datagram's kernel receive stamp (SO_TIMESTAMPNS, which LTP's RTT samples and Early Close clocks use)
    is taken after the emulated delay, as a NIC stamps a packet at the end of a long link. A delayer in the
    receiving host's PREROUTING held packets after the kernel stamped them: every stamp was early by the whole
    delay, and LTP at a host with ingress delay measured a ~0 RTT (found with ``ltp-ps launch --delay``)."""
    import json
    with Lab(n_hosts=2, prefix=_prefix()) as lab:
        h0, h1 = lab.hosts
        if direction == "ingress":
            lab.impair(h1, "ingress", delay_s=0.030)
        else:
            lab.impair(h0, "egress", delay_s=0.030)
        rx = lab.popen(h1, [sys.executable, "-c", _STAMP_RX], stdout=subprocess.PIPE, text=True)
        assert rx.stdout.readline().strip() == "ready"
        lab.run(h0, [sys.executable, "-c", _STAMP_TX, h1.addr], check=True, timeout=30)
        got = json.loads(rx.stdout.readline())
        rx.wait(timeout=10)
    stamps = [stamp for stamp, _ in got]
    assert min(stamps) >= 0.029, got  # stamped after the delay, not when the packet entered the host
    # read soon after the stamp: a stamp early by the 30 ms delay would read about 0.030 late. The median, and each
    # below the delay: on a slow machine the reader is sometimes scheduled over 10 ms late (one CI flake)
    lags = sorted(read - stamp for stamp, read in got)
    assert lags[len(lags) // 2] < 0.010 and lags[-1] < 0.025, got


def test_two_tier_topology():
    with Lab(racks=[2, 2], prefix=_prefix()) as lab:
        assert [h.rack for h in lab.hosts] == [0, 0, 1, 1]
        assert ping(lab, lab.hosts[0], lab.hosts[3], count=2, interval_s=0.01)["received"] == 2
        assert ping(lab, lab.hosts[1], lab.hosts[0], count=2, interval_s=0.01)["received"] == 2
        links = subprocess.run(["ip", "-n", lab.switch_ns, "-o", "link", "show", "type", "bridge"],
                               capture_output=True, text=True).stdout
        assert "ltpspine" in links and "ltpbr0" in links and "ltpbr1" in links
    assert list_netns(lab.prefix + "-") == []


def test_cleanup_after_exception_and_processes_killed():
    prefix = _prefix()
    with pytest.raises(RuntimeError, match="boom"):
        with Lab(n_hosts=2, prefix=prefix) as lab:
            lab.impair(lab.hosts[0], delay_s=0.001)
            p = lab.popen(lab.hosts[1], ["sleep", "60"])
            delayer = next(iter(lab._delayers.values()))
            assert list_netns(prefix + "-")
            raise RuntimeError("boom")
    assert list_netns(prefix + "-") == []
    assert p.poll() is not None and delayer.poll() is not None
    root_links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert "ltpp" not in root_links and "ltpeth" not in root_links


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_cleanup_on_signal(sig):
    prefix = _prefix()
    script = textwrap.dedent(f"""
        import time
        from ltp_tools.netlab import Lab
        with Lab(n_hosts=2, prefix={prefix!r}) as lab:
            lab.impair(lab.hosts[0], delay_s=0.001)
            print("up", flush=True)
            time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "up"
        assert len(list_netns(prefix + "-")) == 3
        p.send_signal(sig)
        assert p.wait(timeout=20) == 128 + sig
    finally:
        if p.poll() is None:
            p.kill()
    assert list_netns(prefix + "-") == []


def test_clean_removes_leftovers():
    prefix = _prefix()
    for n in ("sw", "h0"):
        subprocess.run(["ip", "netns", "add", f"{prefix}-{n}"], check=True)
    subprocess.Popen(["ip", "netns", "exec", f"{prefix}-h0", "sleep", "60"], start_new_session=True)
    time.sleep(0.2)
    removed = clean(prefix + "-")
    assert sorted(removed) == [f"{prefix}-h0", f"{prefix}-sw"]
    assert list_netns(prefix + "-") == []


def test_bad_arguments_say_what_is_wrong(lab):
    with pytest.raises(ValueError, match="direction"):
        lab.impair(lab.hosts[0], "sideways", loss=0.1)
    with pytest.raises(ValueError, match="probability"):
        lab.impair(lab.hosts[0], loss=5)
    with pytest.raises(ValueError, match="jitter"):
        lab.impair(lab.hosts[0], delay_s=0.001, jitter_s=0.002)
    with pytest.raises(KeyError, match="no host"):
        lab.impair("h9", loss=0.1)


def test_backend_reported(lab):
    assert lab.backend.startswith("nftables+tbf+")
    assert lab.backend.split("+")[-1] in ("netem", "nfqueue-delayer", "no-delay")


@pytest.fixture
def gro_lab():
    with Lab(n_hosts=2, prefix=_prefix(), gro=True) as lab:
        yield lab
    assert list_netns(lab.prefix + "-") == []


def _features(ns, ifname):
    out = subprocess.run(["ip", "netns", "exec", ns, "ethtool", "-k", ifname], capture_output=True,
                         text=True, check=True).stdout
    return dict(line.strip().split(": ", 1)[:2] for line in out.splitlines()[1:] if ": " in line)


def test_gro_lab_turns_on_receive_gro_at_the_hosts_only(gro_lab):
    segmentation = ("tcp-segmentation-offload", "generic-segmentation-offload", "tx-udp-segmentation",
                    "rx-gro-list", "rx-udp-gro-forwarding")
    for h in gro_lab.hosts:
        host = _features(h.netns, h.ifname)
        assert host["generic-receive-offload"].startswith("on"), host["generic-receive-offload"]
        assert all(host[f].startswith("off") for f in segmentation), host
        port = _features(gro_lab.switch_ns, h.port)
        assert all(port[f].startswith("off") for f in segmentation + ("generic-receive-offload",)), port
    assert gro_lab.describe()["gro"] is True


@pytest.mark.parametrize("gro", [False, True])
def test_loss_is_per_wire_packet_before_the_receivers_gro(gro):
    """With receive GRO the loss point moves to the switch, so it still drops single wire packets (never a
    coalesced run) and the receiver gets exactly the survivors; the sink sees coalesced reads only with GRO
    (the datagrams leave in bursts, as LTP's GSO sends do, so they reach the receiving interface together)."""
    from ltp_tools.netlab.measure import sink_result, start_udp_sink

    with Lab(n_hosts=2, prefix=_prefix(), gro=gro) as lab:
        h0, h1 = lab.hosts
        lab.impair(h0, "ingress", loss=0.05)
        sink = start_udp_sink(lab, h0, port=9000, idle_s=1.0)
        udp_blast(lab, h1, h0, count=20000, size=1000, port=9000, burst=40)
        got = sink_result(sink)
        st = lab.loss_stats(h0)
        assert st["seen"] == 20000 and st["oversize"] == 0, st
        assert abs(st["measured_loss"] - 0.05) < 0.01, st
        assert got["datagrams"] == 20000 - st["dropped"] and got["bytes"] == 1000 * got["datagrams"], (got, st)
        if gro:
            assert got["coalesced_calls"] > 0 and got["calls"] < got["datagrams"], got
        else:
            assert got["coalesced_calls"] == 0 and got["calls"] == got["datagrams"], got
    assert list_netns(lab.prefix + "-") == []


def test_gro_lab_delivers_tcp_and_keeps_the_oversize_check_at_zero(gro_lab):
    from ltp_tools.tcpbench import run_tcp_transfer

    h0, h1 = gro_lab.hosts
    gro_lab.impair(h0, "ingress", loss=0.01)
    run_tcp_transfer(gro_lab, h1, h0, 30_000_000, "cubic", timeout_s=30)
    st = gro_lab.loss_stats(h0)
    assert st["oversize"] == 0 and st["seen"] > 20000 and st["dropped"] > 0, st


def test_the_tbf_bucket_holds_one_timer_tick_of_tokens(tmp_path):
    """tc-tbf(8)'s minimum bucket, rate / HZ (a 200 us bucket cost kernel TCP half the rate on a machine whose
    qdisc woke late), capped at 64 kB, never under two frames; HZ from the kernel's config, a default where none
    is readable."""
    from ltp_tools.netlab import support
    from ltp_tools.netlab.lab import TBF_MAX_BURST_BYTES, tbf_burst

    assert tbf_burst(100e6, 1514, hz=250) == 50_000 and tbf_burst(100e6, 1514, hz=1000) == 12_500
    assert tbf_burst(1e9, 1514, hz=250) == TBF_MAX_BURST_BYTES == tbf_burst(1e9, 1514, hz=1000)  # a short
    # transfer beats the rate by one bucket at most (before the cap, 2 MB crossed a 1 Gbit/s tbf at 1.23 Gbit/s)
    assert tbf_burst(1e6, 1514, hz=250) == 2 * 1514
    plain = tmp_path / "config"
    plain.write_text("# CONFIG_HZ_100 is not set\nCONFIG_HZ_1000=y\nCONFIG_HZ=1000\n")
    assert support.kernel_hz((str(plain),)) == 1000
    import gzip
    packed = tmp_path / "config.gz"
    with gzip.open(packed, "wt") as f:
        f.write("CONFIG_HZ=300\n")
    assert support.kernel_hz((str(tmp_path / "missing"), str(packed))) == 300
    broken = tmp_path / "broken.gz"
    broken.write_text("not gzip")
    assert support.kernel_hz((str(broken), str(tmp_path / "missing"))) == support.DEFAULT_KERNEL_HZ
    assert support.kernel_hz() > 0
