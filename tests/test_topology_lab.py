"""Lab additions for schedules (racks with shaped uplinks, blocked pairs, rate redraws) and Topology.from_lab."""

from __future__ import annotations

import random
import time

import pytest

from ltp_ps.schedules import Topology

pytestmark = [pytest.mark.netns, pytest.mark.timeout(180)]


@pytest.fixture
def lab():
    netlab = pytest.importorskip("ltp_tools.netlab")
    why = netlab.check_support()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")
    with netlab.Lab(racks=[2, 2]) as lab:
        yield lab
    from ltp_tools.netlab import support
    assert not support.list_netns(lab.prefix + "-"), "the lab left namespaces behind"


def _udp_echo_ok(lab, a, b, timeout=1.0) -> bool:
    """Can host a reach host b (one UDP datagram, answered)?"""
    srv = lab.popen(b, ["python3", "-c",
                        "import socket,sys\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
                        "s.bind(('0.0.0.0',9999))\ns.settimeout(3)\n"
                        "try:\n d,a=s.recvfrom(100); s.sendto(d,a)\nexcept Exception: pass\n"])
    time.sleep(0.3)
    r = lab.run(a, ["python3", "-c",
                    "import socket\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\ns.settimeout(%f)\n"
                    "s.sendto(b'x',('%s',9999))\ntry:\n s.recvfrom(10); print('ok')\nexcept Exception: print('no')\n"
                    % (timeout, lab.hosts[b].addr)], capture_output=True, text=True)
    srv.wait(5)
    return r.stdout.strip() == "ok"


def test_block_and_unblock_a_pair_mid_run(lab):
    assert _udp_echo_ok(lab, 0, 2)
    lab.block(0, 2)
    assert not _udp_echo_ok(lab, 0, 2)
    assert _udp_echo_ok(lab, 0, 1) and _udp_echo_ok(lab, 1, 2)  # only that pair
    assert lab.blocked_pairs() == [("h0", "h2")]
    t = Topology.from_lab(lab)
    assert not t.alive("h0", "h2") and t.alive("h0", "h3")
    lab.unblock("h2", "h0")
    assert _udp_echo_ok(lab, 0, 2) and lab.blocked_pairs() == []


def _throughput_bps(lab, a, b, nbytes=400_000) -> float:
    sink = lab.popen(b, ["python3", "-c",
                         "import socket\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
                         "s.bind(('0.0.0.0',9998))\ns.listen()\nc,_=s.accept()\nn=0\n"
                         "while True:\n d=c.recv(65536)\n if not d: break\n n+=len(d)\n"])
    time.sleep(0.3)
    r = lab.run(a, ["python3", "-c",
                    "import socket,time\ns=socket.create_connection(('%s',9998))\nt=time.monotonic()\n"
                    "s.sendall(bytes(%d))\ns.shutdown(socket.SHUT_WR)\ns.recv(1)\nprint(time.monotonic()-t)\n"
                    % (lab.hosts[b].addr, nbytes)], capture_output=True, text=True)
    sink.wait(10)
    return 8 * nbytes / float(r.stdout.strip())


def test_uplink_rate_and_delay_shape_cross_rack_traffic_only(lab):
    lab.uplink(0, rate_bps=10e6, delay_s=0.02, direction="up")
    cross = _throughput_bps(lab, 0, 2)
    local = _throughput_bps(lab, 0, 1)
    assert cross < 12e6 and local > 3 * cross
    specs = lab.uplink_specs()
    assert specs == [{"rack": 0, "up_bps": 10e6, "down_bps": None, "delay_s": 0.02}]
    t = Topology.from_lab(lab)
    assert t.path_rate("h0", "h2") == 10e6 and t.path_rate("h2", "h0") > 10e6
    with pytest.raises(ValueError, match="rack"):
        lab.uplink(5, rate_bps=1e6)


def test_rates_are_redrawn_every_period(lab):
    t0 = time.monotonic()
    r = lab.redraw_rates([0, 1], 0.3, lambda rng: rng.choice([5e6, 20e6, 50e6]), seed=3)
    while len(r.history) < 3 and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    r.stop()
    elapsed = time.monotonic() - t0
    seen = r.history
    assert 3 <= len(seen) <= elapsed / 0.3 + 2 and not r.errors
    gaps = [b[0] - a[0] for a, b in zip(seen, seen[1:])]
    assert min(gaps) >= 0.29  # never faster than the period
    rng = random.Random(3)
    expect = [{"h0": rng.choice([5e6, 20e6, 50e6]), "h1": rng.choice([5e6, 20e6, 50e6])} for _ in seen]
    assert [h for _, h in seen] == expect  # seeded, reproducible
    assert lab.impairment(0, "egress").rate_bps == seen[-1][1]["h0"]
