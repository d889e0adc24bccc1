"""tcpbench: loopback transfers (no namespaces needed) and a transfer inside the lab."""
import json
import socket
import subprocess
import sys

import pytest

from ltp_tools.payload import pattern
from ltp_tools.ready import wait_ready
from ltp_tools.tcpbench import available_cc, run_tcp_transfer, send

pytestmark = pytest.mark.timeout(60)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(*extra):
    port = _free_port()
    p = subprocess.Popen([sys.executable, "-m", "ltp_tools.tcpbench", "server", "--port", str(port),
                          "--bind", "127.0.0.1", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_ready(p, 30, "tcpbench server")
    return port, p


@pytest.fixture
def server():
    port, p = _start_server()
    yield port, p
    p.kill()
    p.wait(timeout=5)


@pytest.fixture
def sized_server():
    """A server that receives each transfer into one 3,000,001-byte buffer and checks it."""
    port, p = _start_server("--size", "3000001")
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


def test_a_message_sized_transfer_is_received_whole_and_checked(sized_server):
    """The default moves the test message between message-sized buffers (as LTP's benchmarks do), and the
    server checks every byte; two transfers in a row each write their own bytes."""
    port, p = sized_server
    for _ in range(2):
        r = send("127.0.0.1", port, 3_000_001, "cubic")
        assert r["buffer"] == "message" and r["size_bytes"] == 3_000_001
        rx = json.loads(p.stdout.readline())
        assert rx["verified"] is True and rx["buffer"] == "message" and rx["size_bytes"] == 3_000_001


@pytest.mark.parametrize("size, buffer, why", [
    (3_000_001, "chunk", "bytes that are not the test message"),
    (1_000_000, "message", "a transfer shorter than the buffer"),
    (3_500_000, "message", "a transfer longer than the buffer"),
])
def test_a_wrong_transfer_fails_the_servers_check(sized_server, size, buffer, why):
    port, p = sized_server
    r = send("127.0.0.1", port, size, "cubic", buffer=buffer)
    assert r["size_bytes"] == size  # the byte count matched what was sent, so only the check can catch it
    rx = json.loads(p.stdout.readline())
    assert rx["verified"] is False, why
    assert rx["size_bytes"] == size


def test_a_shared_message_buffer_is_sent_as_given(sized_server):
    port, p = sized_server
    data = pattern(3_000_001)
    send("127.0.0.1", port, 3_000_001, "cubic", data=data)
    assert json.loads(p.stdout.readline())["verified"] is True
    with pytest.raises(ValueError, match="data holds 3000001 bytes, size is 5"):
        send("127.0.0.1", port, 5, "cubic", data=data)
    with pytest.raises(ValueError, match="choose one of message, chunk"):
        send("127.0.0.1", port, 5, "cubic", buffer="hot")


def test_a_held_server_checks_only_after_its_release_line():
    """``--hold``: the transfer ends (the client has its reply) but the check waits for a line on stdin."""
    import select
    import time

    port = _free_port()
    p = subprocess.Popen([sys.executable, "-m", "ltp_tools.tcpbench", "server", "--port", str(port), "--bind",
                          "127.0.0.1", "--size", "3000001", "--hold", "--once"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(p, 30, "tcpbench server")
        r = send("127.0.0.1", port, 3_000_001, "cubic")
        assert r["size_bytes"] == 3_000_001
        assert select.select([p.stdout], [], [], 0.5)[0] == [], "the server reported before it was released"
        released = time.monotonic()
        p.stdin.write("go\n")
        p.stdin.flush()
        rx = json.loads(p.stdout.readline())
        assert rx["verified"] is True and rx["check_start_s"] >= released
        assert p.wait(timeout=10) == 0
    finally:
        p.kill()
        p.wait(timeout=5)
    bad = subprocess.run([sys.executable, "-m", "ltp_tools.tcpbench", "server", "--hold"], capture_output=True,
                         text=True, timeout=30)
    assert bad.returncode == 2 and "--hold needs --size" in bad.stderr


def test_the_chunk_buffer_is_not_checked(server):
    """Without ``--size`` the server reads into one reused block: nothing to check (``verified`` null)."""
    port, p = server
    send("127.0.0.1", port, 2_000_000, "cubic", buffer="chunk")
    rx = json.loads(p.stdout.readline())
    assert rx["verified"] is None and rx["buffer"] == "chunk" and rx["size_bytes"] == 2_000_000


def test_wait_ready_names_a_server_that_died_or_stayed_silent():
    dead = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit('boom: cannot bind')"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with pytest.raises(RuntimeError, match=r"tcpbench server did not start .*exit 1.*boom: cannot bind"):
        wait_ready(dead, 10, "tcpbench server")
    from ltp_tools.experiments._common import ExperimentError
    from ltp_tools.experiments._common import wait_ready as experiment_wait_ready

    with pytest.raises(ExperimentError, match="incast PS did not start"):  # the experiments' own error type
        experiment_wait_ready(dead, 10, "incast PS")
    # its output ends before it exits (the race that reported a dying server as "exit None: no output")
    late = subprocess.Popen([sys.executable, "-c", "import os, sys, time; os.close(1); time.sleep(0.3); "
                             "sys.exit('late: cannot bind')"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with pytest.raises(RuntimeError, match=r"tcpbench server did not start \(exit 1\): late: cannot bind"):
        wait_ready(late, 10, "tcpbench server")
    silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with pytest.raises(RuntimeError, match="did not start within 0.5 s"):
            wait_ready(silent, 0.5, "tcpbench server")
    finally:
        silent.kill()
        silent.wait(timeout=5)


def test_the_server_refuses_a_bad_size():
    out = subprocess.run([sys.executable, "-m", "ltp_tools.tcpbench", "server", "--port", "0", "--size", "0"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "--size" in out.stderr


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
        assert r["buffer"] == "message" and r["receiver"]["verified"] is True  # every byte, through 1 % loss
        assert r["receiver"]["peer"] == h1.addr
        assert r["total_retrans"] > 0          # 1 % of ~14k segments were dropped and resent
        st = lab.loss_stats(h0)
        assert st["dropped"] > 0 and st["oversize"] == 0
        with pytest.raises(TimeoutError):
            lab.impair(h0, rate_bps=1e6)
            run_tcp_transfer(lab, h1, h0, 10_000_000, "cubic", port=5202, timeout_s=2)
