"""An aggregating tree worker says when it sent its partial up without a child's (ltp_ps.program_roles).

Seen once in CI (RAT, the aggregator SIGKILLed): after the repair the PS received one contribution a round
for the rest of the run, and nothing in the output said which partials the new aggregator had gone without.
"""

from __future__ import annotations

import types

from ltp_ps.program_roles import _report_missing_partials
from ltp_ps.schedules.base import World
from ltp_ps.schedules.executor import RunResult
from ltp_ps.schedules.rat import RatSchedule
from ltp_ps.transport.base import missing_report


def _round(missing_peers, why="timeout", took=0.0):
    prog = RatSchedule(World(workers=range(4), n_elems=100, shards=((0, 100),))).plan(7).program("worker:0")
    steps = prog.steps()
    res = RunResult(reports=[None] * len(steps), group_s={})
    for i, st in enumerate(steps):
        if st.op == "recv" and st.payload == "partial" and st.peer in missing_peers:
            res.reports[i] = missing_report(("127.0.0.1", 1), st.tag or 0, 400, why, took)
            res.missing.append((i, why))
    return prog, res


def test_the_children_it_went_up_without_are_named_with_why_and_lines_thin_out(capsys):
    w = types.SimpleNamespace(cfg=types.SimpleNamespace(rank=0), short_partial_rounds=0)
    prog, res = _round({"worker:1", "worker:3"}, took=0.25)
    children = {st.peer for st in prog.steps() if st.op == "recv" and st.payload == "partial"}
    assert children == {"worker:1", "worker:2", "worker:3"}  # worker 0 aggregates the only tree
    _report_missing_partials(w, 7, prog, res, excluded=set())
    out = capsys.readouterr().out
    assert "[w0] round 7: sent its partial up without worker:1 (timeout after 0.250 s), worker:3 (timeout " in out
    assert "so far: 1" in out
    # the executor's reason for a receive it never posted (test_executor checks it gives these)
    prog, res = _round({"worker:2"}, why="not waited for: its exchange in group 'down:0:0' did not succeed")
    _report_missing_partials(w, 8, prog, res, excluded=set())
    assert "worker:2 (not waited for: its exchange in group 'down:0:0' did not succeed);" in capsys.readouterr().out
    for it in range(9, 14):  # rounds 3..7 with a child missing: a line at 4 only
        _report_missing_partials(w, it, prog, res, excluded=set())
    assert w.short_partial_rounds == 7
    assert [line.split(":")[0] for line in capsys.readouterr().out.splitlines()] == ["[w0] round 10"]


def test_a_whole_round_and_known_dead_children_say_nothing(capsys):
    w = types.SimpleNamespace(cfg=types.SimpleNamespace(rank=0), short_partial_rounds=0)
    prog, res = _round(set())
    _report_missing_partials(w, 7, prog, res, excluded=set())
    # a partial that came in part (Early Close, a loss) is not missing: the executor lists only empty receives
    prog, res = _round({"worker:2"})
    _report_missing_partials(w, 8, prog, res, excluded={"worker:2"})
    assert w.short_partial_rounds == 0 and capsys.readouterr().out == ""
