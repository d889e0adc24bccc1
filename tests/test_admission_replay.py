"""The issue-7 replay, on loopback sockets: captured REGs replayed from many ports plus a storm of
mutated REGs at a live receiver. Legitimate transfers keep completing bit-exact, the receiver's
memory does not grow (< 64 MB), and every refusal is counted by reason."""

from __future__ import annotations

import asyncio
import random
import socket
import time

import numpy as np
import pytest

import ltp
from ltp import wire
from ltp.config import Config
from ltp.engine import Engine

pytestmark = pytest.mark.timeout(180)

KEY = b"replay-test-key"
MiB = 1 << 20


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _captured_regs(src, dst) -> list:
    """REG datagrams exactly as the endpoint at ``src`` sends them to ``dst`` (what an observer captures):
    64 x 16 MiB reliable, 20 x 1 MiB, 76 x 4 KiB, as in the issue."""
    eng = Engine(Config(job_key=KEY), rng=random.Random(7), local_addr=src,
                 wall_offset=time.time() - time.monotonic())
    big = np.zeros(16 * MiB // 4, np.float32)
    now = time.monotonic()
    for i in range(64):
        eng.send(dst, big, now=now, reliable=True, tag=i)
    for i in range(20):
        eng.send(dst, big[:MiB // 4], now=now, tag=100 + i)
    for i in range(76):
        eng.send(dst, big[:1024], now=now, tag=200 + i)
    regs = [bytes(d) for tx in eng.datagrams_to_send(now) for d in tx.datagrams() if d[0] & 0x0F == wire.T_REG]
    assert len(regs) == 160 * Config().reg_copies
    return regs


async def test_replayed_and_mutated_regs_pin_nothing_while_real_transfers_complete():
    cfg = Config(job_key=KEY)
    a = await ltp.open_endpoint(("127.0.0.1", 0), config=cfg)
    b = await ltp.open_endpoint(("127.0.0.1", 0), config=cfg)
    socks = []
    try:
        data = np.random.default_rng(1).standard_normal(200_000).astype(np.float32)
        out = np.zeros_like(data)
        # warm up (allocations of the first transfer are not the attack's)
        await asyncio.gather(a.send(b.local_addr, data, reliable=True, tag=999), b.recv(out, tag=999))
        regs = _captured_regs(a.local_addr, b.local_addr)
        rss0 = _rss()
        mem0 = b.engine.receive_memory
        socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(160)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
            s.setblocking(False)
        rng = random.Random(3)
        storm = 20_000

        async def attack():
            # 1. the replay: each captured REG once, from 160 other ports
            for s, reg in zip(socks, regs):
                s.sendto(reg, b.local_addr)
            await asyncio.sleep(0)
            # 2. the storm: captured REGs with 1-3 bit flips (half of them in header bytes 8-15)
            for k in range(storm):
                reg = bytearray(rng.choice(regs))
                for _ in range(rng.randint(1, 3)):
                    pos = rng.randrange(8, 16) if rng.random() < 0.5 else rng.randrange(len(reg))
                    reg[pos] ^= 1 << rng.randrange(8)
                try:
                    rng.choice(socks).sendto(bytes(reg), b.local_addr)
                except BlockingIOError:
                    pass
                if k % 200 == 0:
                    await asyncio.sleep(0.001)

        async def legit():
            for it in range(8):
                o = np.zeros_like(data)
                s_rep, r_rep = await asyncio.gather(a.send(b.local_addr, data, reliable=True, tag=it),
                                                    b.recv(o, tag=it, timeout=30))
                assert r_rep.regime == "complete" and np.array_equal(o, data)
                assert s_rep.delivered_fraction == 1.0

        await asyncio.gather(attack(), legit())
        await asyncio.sleep(0.3)  # let the receiver drain what is queued
        st = b.stats
        growth = _rss() - rss0
        assert growth < 64 * MiB, f"receiver process grew {growth / MiB:.1f} MB"
        assert b.engine.receive_memory == mem0 == 0
        assert not b.engine._pending and len(b.engine._rx) == 0
        # every replayed REG was refused as unauthenticated (wrong source address), none admitted
        assert st.refused.get("unauthenticated", 0) >= 160
        assert st.flows_received == 9
        assert set(st.refused) <= {"unauthenticated", "stale", "replayed"}
        # every attack datagram that arrived was dropped and counted with a reason
        # (a loopback socket with a 64 MiB buffer loses next to none of them)
        assert sum(st.dropped.values()) >= 0.95 * (storm + 160)
        print(f"\nRSS growth {growth / MiB:.1f} MB; refused {st.refused}; dropped {st.dropped}")
    finally:
        for s in socks:
            s.close()
        await a.close()
        await b.close()
