"""tcpbench: loopback transfers (no namespaces needed) and a transfer inside the lab."""
import json
import socket
import subprocess
import sys

import pytest

from ltp_tools.tcpbench import available_cc, run_tcp_transfer, send

pytestmark = pytest.mark.timeout(60)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server():
    port = _free_port()
    p = subprocess.Popen([sys.executable, "-m", "ltp_tools.tcpbench", "server", "--port", str(port),
                          "--bind", "127.0.0.1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield port, p
    p.kill()
    p.wait(timeout=5)


@pytest.mark.parametrize("cc", [c for c in ("cubic", "bbr", "reno") if c in available_cc()])
def test_loopback_transfer_each_cc(server, cc):
    port, p = server
    r = send("127.0.0.1", port, 20_000_000, cc)
    assert r["transport"] == "tcp" and r["cc"] == cc and r["size_bytes"] == 20_000_000
    assert r["goodput_gbps"] > 0 and r["duration_s"] > 0 and r["sender_cpu_s"] > 0
    assert abs(r["goodput_gbps"] - 20_000_000 * 8 / r["duration_s"] / 1e9) < 1e-9
    rx = json.loads(p.stdout.readline())
    assert rx["role"] == "receiver" and rx["size_bytes"] == 20_000_000 and "receiver_cpu_s" in rx


def test_client_cli_prints_one_json_line(server):
    port, _ = server
    out = subprocess.run([sys.executable, "-m", "ltp_tools.tcpbench", "client", "--host", "127.0.0.1",
                          "--port", str(port), "--size", "1000000", "--cc", "cubic"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1
    r = json.loads(lines[0])
    assert {"transport", "size_bytes", "goodput_gbps", "duration_s", "sender_cpu_s"} <= set(r)


def test_unknown_cc_is_a_clear_error(server):
    port, _ = server
    with pytest.raises(ValueError, match="not available"):
        send("127.0.0.1", port, 1000, "no-such-cc")


def test_connect_refused_times_out():
    with pytest.raises(ConnectionError, match="cannot connect"):
        send("127.0.0.1", _free_port(), 1000, "cubic", connect_timeout_s=0.3)


def test_run_tcp_transfer_in_lab():
    from ltp_tools.netlab import Lab, check_support

    problem = check_support()
    if problem:
        pytest.skip(f"network lab unavailable: {problem}")
    with Lab(n_hosts=2) as lab:
        h0, h1 = lab.hosts
        lab.impair(h0, loss=0.01)
        r = run_tcp_transfer(lab, h1, h0, 20_000_000, "cubic", timeout_s=30)
        assert r["size_bytes"] == 20_000_000 and r["receiver"]["size_bytes"] == 20_000_000
        assert r["receiver"]["peer"] == h1.addr
        assert r["total_retrans"] > 0          # 1 % of ~14k segments were dropped and resent
        st = lab.loss_stats(h0)
        assert st["dropped"] > 0 and st["oversize"] == 0
        with pytest.raises(TimeoutError):
            lab.impair(h0, rate_bps=1e6)
            run_tcp_transfer(lab, h1, h0, 10_000_000, "cubic", port=5202, timeout_s=2)
