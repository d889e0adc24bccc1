"""Program data model: steps validate, plans check their transfers, JSON round trip."""

import pytest

from ltp_ps.schedules import program as P
from ltp_ps.schedules.tags import PHASE_PUSH, pack


def tiny_plan():
    t = pack(3, PHASE_PUSH, 0, 0, 1)
    w = P.Program("worker:0", ((P.Send("server:0", P.SLOT_GRAD, 0, 8, t, critical=((0, 1), (7, 8))),),))
    s = P.Program("server:0", ((P.Recv("worker:0", "in:worker:0", 0, 8, t, group="grad"),),
                               (P.Combine(P.SLOT_ACC, "in:worker:0", 0, 8), P.Apply(P.SLOT_ACC, 0, 8))))
    return P.RoundPlan("direct", 3, {"worker:0": w, "server:0": s})


def test_plan_checks_and_round_trips():
    plan = tiny_plan()
    plan.check()
    back = P.RoundPlan.from_json(plan.to_json())
    assert back == plan
    assert plan.edges() == [("worker:0", "server:0", 0, 8, plan.edges()[0][4], "tolerant")]
    assert plan.program("worker:9").stages == ()


def test_unmatched_and_mismatched_transfers_are_reported():
    plan = tiny_plan()
    bad = P.RoundPlan("x", 3, {"worker:0": plan.programs["worker:0"]})
    with pytest.raises(ValueError, match="unmatched"):
        bad.check()
    s = P.Program("server:0", ((P.Recv("worker:0", "in", 0, 4, plan.edges()[0][4]),),))
    with pytest.raises(ValueError, match="!="):
        P.RoundPlan("x", 3, {"worker:0": plan.programs["worker:0"], "server:0": s}).check()


def test_step_validation():
    with pytest.raises(ValueError):
        P.Send("a", "b", 5, 4, 0)
    with pytest.raises(ValueError):
        P.Recv("a", "b", 0, 4, 0, mode="maybe")
    with pytest.raises(ValueError, match="node id"):
        P.parse_node("ps:0")
    assert P.parse_node(P.worker(3)) == ("worker", 3)
    with pytest.raises(ValueError, match="unknown step"):
        P.step_from_json({"op": "teleport"})


def test_grant_round_trip():
    g = P.Grant("worker:1", (P.Send("worker:2", "acc", 0, 4, 7),), start_at=1.5)
    assert P.Grant.from_json(g.to_json()) == g
    assert P.Grant.from_json(P.Grant("worker:1", drop=True, reason="late").to_json()).drop


def test_merge_programs_concatenates_stages():
    a = P.Program("n", ((P.Apply("acc", 0, 1),),))
    b = P.Program("n", ((P.Adopt("acc", 0, 1),),))
    assert P.merge_programs([a, b])["n"].stages == a.stages + b.stages
