"""Regimes and close reasons are named once (``ltp.regimes``) and keep their string values.

Reports, logs and JSON written before the enum existed must not change, and
``ltp`` and the PS must use the same members.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

import numpy as np
import pytest

from ltp import wire
from ltp.regimes import CloseReason, Regime, stop_reason

ROOT = pathlib.Path(__file__).resolve().parent.parent
GBIT = 125e6


def test_values_are_the_historic_strings():
    assert {r.value for r in Regime} == {"complete", "early", "deadline", "cancelled", "timeout"}
    assert {r.value for r in CloseReason} == {"acked", "complete", "early", "deadline", "cancelled"}
    for member in list(Regime) + list(CloseReason):
        assert member == member.value and str(member) == member.value and f"{member}" == member.value
        assert json.dumps(member) == json.dumps(member.value)
        assert type(member)(member.value) is member


def test_stop_codes_carry_close_reasons_and_every_regime_has_one():
    assert all(isinstance(v, CloseReason) for v in wire.STOP_REASONS.values())
    for regime in Regime:
        code = wire.STOP_CODES[stop_reason(regime)]
        assert wire.STOP_REASONS[code] == (regime if regime != Regime.TIMEOUT else Regime.DEADLINE)


def test_ps_transport_constants_are_the_enum_members():
    from ltp_ps.transport import base

    assert (base.COMPLETE, base.EARLY, base.DEADLINE, base.CANCELLED, base.TIMEOUT) == tuple(
        Regime[n] for n in ("COMPLETE", "EARLY", "DEADLINE", "CANCELLED", "TIMEOUT"))
    assert all(isinstance(getattr(base, n), Regime) for n in ("COMPLETE", "EARLY", "DEADLINE", "CANCELLED",
                                                             "TIMEOUT"))
    assert isinstance(base.SendReport(("h", 1), 0, 1, 1, 1.0).close_reason, CloseReason)


_LITERAL = re.compile(r"""(?<!`)(regime|close_reason)\s*(==|!=|=|in)\s*\(?\s*"""
                      r"""["'](complete|early|deadline|cancelled|timeout|acked)["']""")
_MODULES = ["ltp/engine.py", "ltp/endpoint.py", "ltp/receiver.py", "ltp/early_close.py", "ltp/admission.py", "ltp/matching.py",
            "ltp/timers.py", "ps/transport/base.py", "ps/transport/tcp.py", "ps/transport/memory.py",
            "ps/transport/ltp.py", "ps/schedules/driver.py", "ps/server.py", "ps/schedule.py", "ps/worker.py"]


def test_the_literal_pattern_catches_what_it_must():
    for bad in ('regime == "timeout"', "close_reason='acked'", 'regime in ("early", "deadline")',
                'regime="complete"'):
        assert _LITERAL.search(bad), bad
    assert not _LITERAL.search("regime == Regime.TIMEOUT")


@pytest.mark.parametrize("rel", _MODULES)
def test_no_regime_string_literals(rel):
    path = ROOT / rel
    hits = [m.group(0) for m in _LITERAL.finditer(path.read_text())]
    assert not hits, f"{rel} spells regimes as strings: {hits}; use ltp.regimes.Regime / CloseReason"


def test_engine_reports_carry_members_and_serialise_as_before(harness):
    h = harness(seed=3)
    h.links(rate=GBIT, delay_s=0.0005)
    a, b = h.engines
    data = np.arange(50_000, dtype=np.float32)
    out = np.zeros_like(data)
    hs = a.send(h.addrs[1], data, now=h.now)
    hr = b.post_receive([(h.addrs[0], 0, out)], now=h.now)
    sent, recv = h.wait([(0, hs), (1, hr)])
    rep = recv.reports[0]
    assert rep.regime is Regime.COMPLETE and sent.report.close_reason is CloseReason.ACKED
    plain = dataclasses.replace(rep, regime="complete")
    assert json.dumps(dataclasses.asdict(rep), default=str) == json.dumps(dataclasses.asdict(plain), default=str)
    # a receive nobody sends to times out with the TIMEOUT member
    hr2 = b.post_receive([(h.addrs[0], 7, np.zeros(4, np.float32))], now=h.now, timeout=0.01)
    (late,) = h.wait([(1, hr2)])
    assert late.reports[0].regime is Regime.TIMEOUT
