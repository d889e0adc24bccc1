"""Kernel-TCP bulk transfer: the baseline LTP is compared against.

Theory of operation
    ``server`` accepts connections; for each it reads until EOF, then replies with the
    8-byte count of bytes received, so the client's clock stops only when every byte has
    reached the receiving application (not when the last byte left the send buffer).
    ``client`` sets TCP_CONGESTION on its socket before connecting (cubic, bbr, reno, ...),
    sends ``--size`` bytes from a reused buffer, half-closes, waits for the count and prints
    ONE JSON line: transport, cc, size_bytes, goodput_gbps, duration_s, sender_cpu_s (user +
    system CPU of the sending process during the transfer), plus TCP_INFO's retransmission
    count and smoothed RTT. The server prints one JSON line per connection for its receive
    side. :func:`run_tcp_transfer` runs both inside a :class:`~ltp_tools.netlab.Lab`.

    python -m ltp_tools.tcpbench server --port 5201 [--once]
    python -m ltp_tools.tcpbench client --host 10.77.0.1 --port 5201 --size 100000000 --cc bbr
"""
from __future__ import annotations

import argparse
import json
import resource
import socket
import struct
import sys
import time

from ltp_tools.machine_cpu import machine_cpu_s

CHUNK = 256 * 1024  # bytes per send() call
CONNECT_RETRY_S = 10.0  # seconds the client retries a refused connect (server still starting)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def available_cc() -> list[str]:
    """Congestion controls the kernel offers (``tcp_available_congestion_control``)."""
    try:
        with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
            return f.read().split()
    except OSError:
        return []


def _tcp_info(sock: socket.socket) -> dict:
    """Total retransmissions and smoothed RTT (µs) from TCP_INFO (struct tcp_info, Linux)."""
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    except OSError:
        return {}
    if len(raw) < 104:
        return {}
    u32 = struct.unpack_from("=24I", raw, 8)  # after 8 one-byte fields
    return dict(rtt_us=u32[15], total_retrans=u32[23], snd_cwnd=u32[18])


def serve(port: int, once: bool = False, bind: str = "0.0.0.0", out=sys.stdout) -> None:
    """Accept connections on ``port``; print one JSON line per finished transfer."""
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((bind, port))
    ls.listen(16)
    buf = bytearray(CHUNK)
    while True:
        conn, peer = ls.accept()
        with conn:
            cpu0 = _cpu_s()
            t0 = None
            total = 0
            while True:
                n = conn.recv_into(buf)
                if n == 0:
                    break
                if t0 is None:
                    t0 = time.monotonic()
                total += n
            dur = time.monotonic() - t0 if t0 is not None else 0.0
            conn.sendall(struct.pack("!Q", total))
            info = _tcp_info(conn)
        res = dict(transport="tcp", role="receiver", peer=peer[0], size_bytes=total,
                   goodput_gbps=total * 8 / dur / 1e9 if dur > 0 else 0.0, duration_s=dur,
                   receiver_cpu_s=_cpu_s() - cpu0, rcv_rtt_us=info.get("rtt_us"))
        print(json.dumps(res), file=out, flush=True)
        if once:
            break
    ls.close()


def send(host: str, port: int, size: int, cc: str = "cubic", connect_timeout_s: float = CONNECT_RETRY_S) -> dict:
    """Send ``size`` bytes to a tcpbench server with congestion control ``cc``; return the result dict."""
    if size <= 0:
        raise ValueError(f"size must be positive, got {size}")
    deadline = time.monotonic() + connect_timeout_s
    while True:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc.encode())
        except OSError as e:
            s.close()
            raise ValueError(f"congestion control {cc!r} is not available (kernel offers {available_cc()}); "
                             f"load it with `modprobe tcp_{cc}`") from e
        try:
            s.connect((host, port))
            break
        except (ConnectionRefusedError, OSError) as e:
            s.close()
            if time.monotonic() > deadline:
                raise ConnectionError(f"cannot connect to tcpbench server {host}:{port}: {e}") from e
            time.sleep(0.05)
    got_cc = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0")[0].decode()
    block = memoryview(bytearray(b"\x5a" * CHUNK))
    cpu0 = _cpu_s()
    m0 = machine_cpu_s()
    t0 = time.monotonic()
    left = size
    while left > 0:
        n = s.send(block[:min(CHUNK, left)])
        left -= n
    info = _tcp_info(s)
    s.shutdown(socket.SHUT_WR)
    ack = b""
    while len(ack) < 8:
        chunk = s.recv(8 - len(ack))
        if not chunk:
            raise ConnectionError("server closed without confirming the byte count")
        ack += chunk
    dur = time.monotonic() - t0
    cpu = _cpu_s() - cpu0
    m1 = machine_cpu_s()
    s.close()
    (received,) = struct.unpack("!Q", ack)
    if received != size:
        raise ConnectionError(f"server received {received} bytes, sent {size}")
    return dict(transport="tcp", cc=got_cc, size_bytes=size, goodput_gbps=size * 8 / dur / 1e9,
                duration_s=dur, sender_cpu_s=cpu, rtt_us=info.get("rtt_us"),
                machine_cpu_s=None if m0 is None or m1 is None else round(m1 - m0, 3),
                total_retrans=info.get("total_retrans"))


def run_tcp_transfer(lab, src_host, dst_host, size: int, cc: str = "cubic", port: int = 5201,
                     timeout_s: float = 120.0) -> dict:
    """Run one tcpbench transfer of ``size`` bytes from ``src_host`` to ``dst_host`` inside ``lab``.

    Returns the client's result dict with the server's JSON under ``"receiver"``. Raises
    ``TimeoutError`` when the transfer does not finish within ``timeout_s`` seconds, and
    ``RuntimeError`` with the processes' stderr when either side fails.
    """
    import subprocess

    dst = lab._host(dst_host)
    server = lab.popen(dst, [sys.executable, "-m", "ltp_tools.tcpbench", "server", "--port", str(port), "--once"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        try:
            r = lab.run(src_host, [sys.executable, "-m", "ltp_tools.tcpbench", "client", "--host", dst.addr,
                                   "--port", str(port), "--size", str(size), "--cc", cc],
                        capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise TimeoutError(f"TCP transfer of {size} B ({cc}) did not finish within {timeout_s} s") from e
        if r.returncode != 0:
            raise RuntimeError(f"tcpbench client failed: {r.stderr.strip()}")
        result = json.loads(r.stdout.strip().splitlines()[-1])
        out, err = server.communicate(timeout=10)
        if server.returncode != 0:
            raise RuntimeError(f"tcpbench server failed: {err.strip()}")
        result["receiver"] = json.loads(out.strip().splitlines()[-1])
        return result
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=5)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ltp_tools.tcpbench", description="Kernel-TCP bulk transfer baseline.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("server", help="receive transfers, print one JSON line each")
    s.add_argument("--port", type=int, default=5201)
    s.add_argument("--bind", default="0.0.0.0")
    s.add_argument("--once", action="store_true", help="exit after one transfer")
    c = sub.add_parser("client", help="send SIZE bytes, print one JSON line")
    c.add_argument("--host", required=True)
    c.add_argument("--port", type=int, default=5201)
    c.add_argument("--size", type=int, required=True, help="bytes to send")
    c.add_argument("--cc", default="cubic", help=f"congestion control (available: {' '.join(available_cc())})")
    c.add_argument("--connect-timeout", type=float, default=CONNECT_RETRY_S)
    a = ap.parse_args(argv)
    if a.cmd == "server":
        try:
            serve(a.port, once=a.once, bind=a.bind)
        except KeyboardInterrupt:
            pass
        return 0
    try:
        res = send(a.host, a.port, a.size, a.cc, a.connect_timeout)
    except (ValueError, ConnectionError) as e:
        print(f"tcpbench: {e}", file=sys.stderr)
        return 1
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
