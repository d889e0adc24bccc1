"""Kernel-TCP bulk transfer: the baseline LTP is compared against.

Theory of operation
    ``server`` accepts connections; for each it reads until EOF, then replies with the
    8-byte count of bytes received, so the client's clock stops only when every byte has
    reached the receiving application (not when the last byte left the send buffer).
    ``client`` sets TCP_CONGESTION on its socket before connecting (cubic, bbr, reno, ...),
    sends ``--size`` bytes, half-closes, waits for the count and prints ONE JSON line:
    transport, cc, size_bytes, goodput_gbps, duration_s, sender_cpu_s (user + system CPU of
    the sending process during the transfer), plus TCP_INFO's retransmission count and
    smoothed RTT. The server prints ``READY`` once it listens, then one JSON line per
    connection for its receive side. :func:`run_tcp_transfer` runs both inside a
    :class:`~ltp_tools.netlab.Lab`.

    Where the bytes live (``--buffer``, :data:`BUFFERS`): ``message`` (the default) moves the
    test message of :mod:`ltp_tools.payload` the way the LTP benchmarks do: the client sends
    from one buffer of ``--size`` bytes, filled before its clock, and the server (given the
    same ``--size``) receives into one buffer of that size, faulted in before ``READY``, and
    checks every byte after replying (``verified``). ``chunk`` resends one CHUNK-sized block
    and reads into another, both cache-hot; it is what this baseline did before 2026-11-29
    and flatters TCP's CPU per byte by the memory traffic it skips (docs/performance.md).
    Both read and write at most CHUNK bytes per call.

    python -m ltp_tools.tcpbench server --port 5201 [--once] [--size 100000000]
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

from ltp_tools.argtypes import number
from ltp_tools.machine_cpu import machine_cpu_s
from ltp_tools.ready import wait_ready

CHUNK = 256 * 1024  # bytes per send() / recv_into() call
#: where a transfer's bytes live (module docstring): "message" is the default, "chunk" the old cache-hot block
BUFFERS = ("message", "chunk")
#: seconds a server may take to start and fault in its receive buffer, plus this per byte of it
READY_BASE_S, READY_PER_BYTE_S = 30.0, 1e-8
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


def serve(port: int, once: bool = False, bind: str = "0.0.0.0", out=sys.stdout, size: int | None = None,
          hold: bool = False) -> None:
    """Accept connections on ``port``; print ``READY`` once listening, then one JSON line per finished transfer.

    With ``size`` every transfer is received into one buffer of ``size`` bytes (faulted in before ``READY``)
    and checked against the test message after the reply (``verified``: false for a short, long or wrong
    transfer; ``check_start_s``: when the check began, CLOCK_MONOTONIC); without it, into one reused
    CHUNK-sized block (``verified``: null). ``hold``: before that check, wait for one line on stdin, so a
    benchmark whose receivers share the sender's machine starts their checks after its clock stopped, not
    while other transfers are still running.
    """
    if size is not None and size <= 0:
        raise ValueError(f"size must be positive, got {size}")
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((bind, port))
    ls.listen(16)
    scratch = bytearray(CHUNK)
    msg = None
    if size is not None:
        import numpy as np

        msg = np.empty(size, np.uint8)
        msg.fill(0)  # fault the pages in before the clock
    print("READY", file=out, flush=True)
    while True:
        conn, peer = ls.accept()
        with conn:
            view = memoryview(msg) if msg is not None else None
            cpu0 = _cpu_s()
            t0 = None
            total = 0
            while True:
                if view is not None and total < size:
                    n = conn.recv_into(view[total:], min(CHUNK, size - total))
                else:  # chunk mode, or bytes past the message (counted, and the transfer fails its check)
                    n = conn.recv_into(scratch)
                if n == 0:
                    break
                if t0 is None:
                    t0 = time.monotonic()
                total += n
            dur = time.monotonic() - t0 if t0 is not None else 0.0
            cpu = _cpu_s() - cpu0
            conn.sendall(struct.pack("!Q", total))
            info = _tcp_info(conn)
        verified = check_start = None
        if msg is not None:
            from ltp_tools.payload import verify

            if hold:
                sys.stdin.readline()
            check_start = time.monotonic()
            verified = total == size and verify(msg)
            msg.fill(0)  # the next transfer must write its own bytes to pass
        res = dict(transport="tcp", role="receiver", peer=peer[0], size_bytes=total,
                   goodput_gbps=total * 8 / dur / 1e9 if dur > 0 else 0.0, duration_s=dur,
                   receiver_cpu_s=cpu, rcv_rtt_us=info.get("rtt_us"), verified=verified, check_start_s=check_start,
                   buffer="chunk" if msg is None else "message")
        print(json.dumps(res), file=out, flush=True)
        if once:
            break
    ls.close()


def send(host: str, port: int, size: int, cc: str = "cubic", connect_timeout_s: float = CONNECT_RETRY_S,
         buffer: str = "message", data=None) -> dict:
    """Send ``size`` bytes to a tcpbench server with congestion control ``cc``; return the result dict.

    ``buffer="message"`` sends the test message from one buffer of ``size`` bytes (``data``, when given, is
    that buffer, e.g. shared by the threads of a broadcast); ``"chunk"`` resends one cache-hot block.
    """
    if size <= 0:
        raise ValueError(f"size must be positive, got {size}")
    if buffer not in BUFFERS:
        raise ValueError(f"buffer={buffer!r}: choose one of {', '.join(BUFFERS)}")
    if buffer == "message":
        if data is None:
            from ltp_tools.payload import pattern

            data = pattern(size)
        block = memoryview(data).cast("B")
        if len(block) != size:
            raise ValueError(f"data holds {len(block)} bytes, size is {size}")
    else:
        block = memoryview(bytearray(b"\x5a" * CHUNK))
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
    cpu0 = _cpu_s()
    m0 = machine_cpu_s()
    t0 = time.monotonic()
    left = size
    while left > 0:
        at = size - left if buffer == "message" else 0
        n = s.send(block[at:at + min(CHUNK, left)])
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
                duration_s=dur, sender_cpu_s=cpu, rtt_us=info.get("rtt_us"), buffer=buffer,
                machine_cpu_s=None if m0 is None or m1 is None else round(m1 - m0, 3),
                total_retrans=info.get("total_retrans"))


def run_tcp_transfer(lab, src_host, dst_host, size: int, cc: str = "cubic", port: int = 5201,
                     timeout_s: float = 120.0, buffer: str = "message") -> dict:
    """Run one tcpbench transfer of ``size`` bytes from ``src_host`` to ``dst_host`` inside ``lab``.

    ``buffer`` says where the bytes live (module docstring). Returns the client's result dict with the
    server's JSON under ``"receiver"``. Raises ``TimeoutError`` when the transfer does not finish within
    ``timeout_s`` seconds, and ``RuntimeError`` with the processes' stderr when either side fails.
    """
    import subprocess

    if buffer not in BUFFERS:
        raise ValueError(f"buffer={buffer!r}: choose one of {', '.join(BUFFERS)}")
    dst = lab._host(dst_host)
    sized = ["--size", str(size)] if buffer == "message" else []
    server = lab.popen(dst, [sys.executable, "-m", "ltp_tools.tcpbench", "server", "--port", str(port), "--once",
                             *sized], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(server, READY_BASE_S + size * READY_PER_BYTE_S, "tcpbench server")
        try:
            r = lab.run(src_host, [sys.executable, "-m", "ltp_tools.tcpbench", "client", "--host", dst.addr,
                                   "--port", str(port), "--size", str(size), "--cc", cc, "--buffer", buffer],
                        capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise TimeoutError(f"TCP transfer of {size} B ({cc}) did not finish within {timeout_s} s") from e
        if r.returncode != 0:
            raise RuntimeError(f"tcpbench client failed: {r.stderr.strip()}")
        result = json.loads(r.stdout.strip().splitlines()[-1])
        out, err = server.communicate(timeout=30 + size * READY_PER_BYTE_S)
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
    s.add_argument("--size", type=number(int, 1, what="the receive buffer size"), default=None,
                   help="receive each transfer into one buffer of SIZE bytes and check it (default: a reused block)")
    s.add_argument("--hold", action="store_true",
                   help="with --size: check a transfer only after a line arrives on stdin (receivers that share "
                        "the sender's machine, released once the sender's clock stopped)")
    c = sub.add_parser("client", help="send SIZE bytes, print one JSON line")
    c.add_argument("--host", required=True)
    c.add_argument("--port", type=int, default=5201)
    c.add_argument("--size", type=int, required=True, help="bytes to send")
    c.add_argument("--cc", default="cubic", help=f"congestion control (available: {' '.join(available_cc())})")
    c.add_argument("--connect-timeout", type=float, default=CONNECT_RETRY_S)
    c.add_argument("--buffer", choices=BUFFERS, default="message",
                   help="send from one message-sized buffer (default) or resend one cache-hot block")
    a = ap.parse_args(argv)
    if a.cmd == "server":
        try:
            if a.hold and a.size is None:
                ap.error("--hold needs --size (only a message-sized transfer is checked)")
            serve(a.port, once=a.once, bind=a.bind, size=a.size, hold=a.hold)
        except KeyboardInterrupt:
            pass
        return 0
    try:
        res = send(a.host, a.port, a.size, a.cc, a.connect_timeout, buffer=a.buffer)
    except (ValueError, ConnectionError) as e:
        print(f"tcpbench: {e}", file=sys.stderr)
        return 1
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
