"""Predicted communication time of a round plan: its transfers as a flow DAG on the fluid simulator.

Each ``Send``/``Forward`` of a program becomes one flow; a flow of stage ``k``
of node ``n`` starts after every transfer of ``n``'s earlier stages finished
(the executor runs stages in order), which also makes it wait for the
receives it combines.  Rates are max-min fair on the world's topology
(``ltp_ps.schedules.fluid``); compute time is not included.  Sizes follow the
wire: a 64-byte header plus 4 bytes per element (``note``: 8 bytes), scaled
so that the whole model is ``nbytes`` when given.
"""

from __future__ import annotations

from .base import World
from .program import RoundPlan

HEADER_BYTES = 64
NOTE_BYTES = 8
ELEM = 4


def plan_flows(plan: RoundPlan, world: World, nbytes: int | None = None) -> list:
    """The plan's transfers as ``fluid.Flow`` objects (named ``(src, dst, tag)``)."""
    from .fluid import Flow

    scale = 1.0 if not nbytes or not world.n_elems else nbytes / (ELEM * world.n_elems)
    names = {}
    for node, prog in plan.programs.items():
        for st in prog.stages:
            for s in st:
                if s.op in ("send", "forward"):
                    names[(node, s.peer, s.tag)] = s
    flows = []
    for node, prog in sorted(plan.programs.items()):
        deps: list = []
        for st in prog.stages:
            mine = []
            for s in st:
                if s.op in ("send", "forward"):
                    size = NOTE_BYTES if s.payload in ("note", "grant") else HEADER_BYTES + ELEM * (s.hi - s.lo) * scale
                    name = (node, s.peer, s.tag)
                    flows.append(Flow(name, node, s.peer, size, after=tuple(deps)))
                    mine.append(name)
                elif s.op == "recv":
                    if s.tag is None:
                        mine += [k for k in names if k[0] == s.peer and k[1] == node]
                    elif (s.peer, node, s.tag) in names:
                        mine.append((s.peer, node, s.tag))
            deps = deps + mine
    return flows


def predict_round_s(plan: RoundPlan, world: World, nbytes: int | None = None) -> float:
    """Seconds for the plan's communication on ``world.topology`` (uniform 10 Gbit/s when none)."""
    from .fluid import FluidNetwork, simulate

    net = FluidNetwork.from_topology(world.effective_topology())
    flows = plan_flows(plan, world, nbytes)
    if not flows:
        return 0.0
    return float(simulate(net, flows).completion_s)
