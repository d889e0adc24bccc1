"""The kernel drop counters ``ltp-bench`` reports beside its resends (:mod:`ltp_tools.kernel_drops`)."""

from __future__ import annotations

import sys

import pytest

from ltp_tools import kernel_drops

SNMP = """Ip: Forwarding DefaultTTL InReceives
Ip: 1 64 12345
Udp: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors SndbufErrors InCsumErrors IgnoredMulti MemErrors
Udp: 5368070 3473 62460 5511490 62452 7 0 0 0
UdpLite: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors SndbufErrors InCsumErrors IgnoredMulti MemErrors
UdpLite: 0 0 0 0 0 0 0 0 0
"""

SOFTNET = """0c51a1f6 00002f49 0000000b 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000
0bfcf702 00005748 00000008 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000
"""


def test_udp_drops_reads_the_udp_rows_and_not_udplite(tmp_path):
    p = tmp_path / "snmp"
    p.write_text(SNMP)
    assert kernel_drops.udp_drops(str(p)) == dict(udp_rcvbuf_errors=62452, udp_sndbuf_errors=7, udp_in_errors=62460)


def test_backlog_drops_sums_the_second_hex_column_of_every_cpu(tmp_path):
    p = tmp_path / "softnet"
    p.write_text(SOFTNET)
    assert kernel_drops.backlog_drops(str(p)) == 0x2F49 + 0x5748


@pytest.mark.parametrize("text", ["", "Udp: InDatagrams\n", "Udp: RcvbufErrors SndbufErrors InErrors\nUdp: 1 x 3\n"])
def test_an_unreadable_or_foreign_snmp_file_gives_none(tmp_path, text):
    p = tmp_path / "snmp"
    p.write_text(text)
    assert kernel_drops.udp_drops(str(p)) is None
    assert kernel_drops.udp_drops(str(tmp_path / "absent")) is None


def test_a_garbled_softnet_file_gives_none(tmp_path):
    p = tmp_path / "softnet"
    p.write_text("0c51a1f6\n")
    assert kernel_drops.backlog_drops(str(p)) is None
    p.write_text("0c51a1f6 zz\n")
    assert kernel_drops.backlog_drops(str(p)) is None
    assert kernel_drops.backlog_drops(str(tmp_path / "absent")) is None


def test_delta_subtracts_per_counter_and_needs_both_snapshots():
    assert kernel_drops.delta(dict(a=1, b=5), dict(a=4, b=5, c=9)) == dict(a=3, b=0)
    assert kernel_drops.delta(None, dict(a=1)) is None
    assert kernel_drops.delta(dict(a=1), None) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/net is Linux only")
def test_this_machines_counters_read_as_counts():
    udp = kernel_drops.udp_drops()
    assert udp is not None and all(isinstance(v, int) and v >= 0 for v in udp.values())
    backlog = kernel_drops.backlog_drops()
    assert backlog is not None and backlog >= 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/net is Linux only")
def test_a_full_receive_buffer_shows_in_the_counter():
    """A socket nobody reads, with the smallest buffer, overflows: the kernel's count moves by what it dropped."""
    import socket

    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)  # the kernel rounds it up to its minimum
        rx.bind(("127.0.0.1", 0))
        before = kernel_drops.udp_drops()
        for _ in range(200):
            tx.sendto(b"x" * 1200, rx.getsockname())
        d = kernel_drops.delta(before, kernel_drops.udp_drops())
        assert d["udp_rcvbuf_errors"] >= 150 and d["udp_in_errors"] >= d["udp_rcvbuf_errors"], d
    finally:
        rx.close()
        tx.close()
