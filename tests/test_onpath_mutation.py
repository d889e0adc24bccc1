"""Mutated copies of a live transfer's own datagrams, from the right address, never escape.

An on-path attacker (or a path whose checksums are off) replays every datagram of a
transfer with a few bytes changed, truncated or extended, each copy arriving
just before (or just after) the genuine one and carrying the genuine source address, so it passes the
address check and often the flow token. Whatever the engine makes of a copy (drop
it and count why, take a forged DATA segment, close on a forged STOP), it must not
raise out of ``receive_datagram`` or a timer, every operation must still end with
an event within a bounded time, and the same engines must afterwards move a clean
message whole. Bytes of a flipped DATA payload can land in the destination (LTP's
DATA carries no MAC; UDP's checksum is what stops this on a real path), so the
attacked transfer's contents are not asserted, only that it ends.

The loopback tier mounts the same attack on two live endpoints with a packet socket (root only), so the copies
also go through ``recvmmsg`` and the compiled bulk drain. Both tiers run against the compiled modules and, in
CI's twins stage, the pure-Python twins.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import struct
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ltp import wire
from ltp.config import Config

from conftest import SimHarness

GBIT = 125e6
#: one DATA datagram at the default MTU (header + a float32 segment): a UDP-GSO super-datagram is cut at this size
DATAGRAM = wire.HEADER_SIZE + Config().segment_size_for(4)


def _mutate(data: bytes, rng: random.Random, span: int) -> bytes:
    """One of: a few bytes XORed within the first ``span`` bytes, a truncation, an extension."""
    b = bytearray(data)
    kind = rng.random()
    if kind < 0.7 or len(b) < 2:
        for _ in range(rng.randint(1, 4) if b else 0):
            b[rng.randrange(min(len(b), span))] ^= rng.randint(1, 255)
    elif kind < 0.85:
        del b[rng.randrange(1, len(b)):]
    else:
        b += bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64)))
    return bytes(b)


def _attack(h: SimHarness, rate: float, span: int, seed: int, before: bool) -> None:
    """Every datagram delivered to either engine comes with, at probability ``rate``, a mutated copy just
    ``before`` (or just after) it."""
    rng = random.Random(seed)
    for eng in h.engines:
        genuine = eng.receive_datagram

        def receive(data, addr, now, _genuine=genuine):
            forged = _mutate(bytes(data), rng, span) if rng.random() < rate else None
            if forged is not None and before:
                _genuine(forged, addr, now)
            _genuine(data, addr, now)
            if forged is not None and not before:
                _genuine(forged, addr, now)

        eng.receive_datagram = receive


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), rate=st.sampled_from([0.05, 0.3, 1.0]), span=st.sampled_from([16, 48, 1500]),
       before=st.booleans(), reliable=st.booleans(), loss=st.sampled_from([0.0, 0.02]))
# found by CI (session 54): a mutated REG copy took the sender's next flow id and claimed a 1 s round trip; the
# clean message's REGs were dropped as collisions until its dead-peer limit (ltp/admission.py, superseding)
@example(seed=462, rate=1.0, span=16, before=False, reliable=False, loss=0.0)
def test_mutated_copies_never_raise_every_operation_ends_and_the_engines_still_work(seed, rate, span, before,
                                                                                     reliable, loss):
    h = SimHarness(n_hosts=2, seed=seed % 97, config=Config(peer_silence_min_s=0.5))
    h.links(rate=GBIT / 10, delay_s=0.001, loss=loss)
    a, b = h.engines
    rs = np.random.default_rng(seed)
    data = rs.standard_normal(60_000).astype(np.float32)
    _attack(h, rate, span, seed, before)
    hs = a.send(h.addrs[1], data, now=h.now, reliable=reliable)
    hr = b.post_receive([(h.addrs[0], 0, np.zeros_like(data))], now=h.now, timeout=5.0)
    sent, got = h.wait([(0, hs), (1, hr)], timeout=30.0)  # both end (complete, cut short or failed): no hang
    assert (sent.report is None) != (sent.error is None), sent  # a report or an error, never neither
    assert len(got.reports) == 1 or got.error is not None, got
    dropped = sum(a.stats.dropped.values()) + sum(b.stats.dropped.values())
    if rate == 1.0 and span == 16:
        assert dropped > 0, "every datagram had a mutated header copy, and none was dropped and counted"

    # the attack stops; the same engines move a fresh message whole, under a new tag
    for eng in h.engines:
        del eng.receive_datagram
    h.links(rate=GBIT / 10, delay_s=0.001)
    clean = rs.standard_normal(30_000).astype(np.float32)
    out = np.zeros_like(clean)
    hs2 = a.send(h.addrs[1], clean, now=h.now, tag=7, reliable=True)
    hr2 = b.post_receive([(h.addrs[0], 7, out)], now=h.now, timeout=10.0)
    sent2, got2 = h.wait([(0, hs2), (1, hr2)], timeout=30.0)
    assert sent2.error is None, sent2.error
    assert got2.reports[0].regime == "complete", got2.reports[0]
    assert np.array_equal(out, clean)


# ---------------------------------------------------------------- loopback tier: the compiled receive path
def _raw_sockets():
    """A sniffer on ``lo`` and a raw UDP sender, or None without CAP_NET_RAW."""
    try:
        sniff = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0800))
    except (AttributeError, OSError):  # no AF_PACKET, or no CAP_NET_RAW (PermissionError is an OSError)
        return None
    try:
        sniff.bind(("lo", 0))
        raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP)
    except OSError:
        sniff.close()
        return None
    sniff.settimeout(0.05)
    return sniff, raw


def _inject(sniff, raw, ports: set, stop: threading.Event, rng: random.Random, counts: dict) -> None:
    """Re-send a mutated copy of every LTP datagram seen on ``lo`` towards ``ports``, from its genuine source
    port (a UDP checksum of 0: none). A UDP-GSO super-datagram is cut into its :data:`DATAGRAM`-byte datagrams first."""
    while not stop.is_set():
        try:
            frame, meta = sniff.recvfrom(70_000)
        except (socket.timeout, OSError):
            continue
        if meta[2] == socket.PACKET_OUTGOING:
            continue
        ip = frame[14:]
        ihl = (ip[0] & 0x0F) * 4
        if len(ip) < ihl + 8 or ip[9] != socket.IPPROTO_UDP:
            continue
        sport, dport = struct.unpack("!HH", ip[ihl:ihl + 4])
        if dport not in ports:
            continue
        body = ip[ihl + 8:]
        for off in range(0, len(body), DATAGRAM):
            forged = _mutate(bytes(body[off:off + DATAGRAM]), rng, rng.choice([16, 48, 1500]))
            try:
                raw.sendto(struct.pack("!HHHH", sport, dport, 8 + len(forged), 0) + forged, ("127.0.0.1", 0))
                counts["injected"] += 1
            except OSError:
                pass


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", [1, 2])
async def test_mutated_copies_on_loopback_never_reach_the_event_loop(seed, caplog):
    """The same attack against two live endpoints: a sniffer on ``lo`` re-sends a mutated copy of each of their
    datagrams with the genuine source port, so the copies go through the socket, ``recvmmsg`` and the compiled
    bulk drain. Every transfer ends, the event loop logs no error, and a clean message afterwards arrives exact."""
    import ltp

    socks = _raw_sockets()
    if socks is None:
        pytest.skip("needs CAP_NET_RAW (root) for a packet socket on lo and a raw UDP socket")
    sniff, raw = socks
    rng = random.Random(seed)
    counts = {"injected": 0}
    async with await ltp.open_endpoint(("127.0.0.1", 0)) as a, await ltp.open_endpoint(("127.0.0.1", 0)) as b:
        stop = threading.Event()
        t = threading.Thread(target=_inject, args=(sniff, raw, {a.local_addr[1], b.local_addr[1]}, stop, rng, counts))
        t.start()
        try:
            for tag, n in enumerate((1_000, 400_000, 2_000_000)):
                data = np.random.default_rng(tag).standard_normal(n).astype(np.float32)
                out = np.zeros_like(data)
                await asyncio.gather(a.send(b.local_addr, data, tag=tag, reliable=tag % 2 == 0, timeout=30),
                                     b.recv(out, peer=a.local_addr, tag=tag, timeout=30), return_exceptions=True)
        finally:
            stop.set()
            await asyncio.to_thread(t.join)
            sniff.close()
            raw.close()
        clean = np.arange(300_000, dtype=np.float32)
        out = np.zeros_like(clean)
        await asyncio.gather(a.send(b.local_addr, clean, tag=99, reliable=True, timeout=30),
                             b.recv(out, peer=a.local_addr, tag=99, timeout=30))
        assert np.array_equal(out, clean)
        dropped = sum(a.stats.dropped.values()) + sum(b.stats.dropped.values())
    assert counts["injected"] > 100, counts
    assert dropped > 0, counts
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
