"""Experiments of the LTP paper's evaluation, as ``ltp-lab`` subcommands and a Python API.

    from ltp_tools.experiments import loss_sweep, incast, fairness
    res = loss_sweep.run(quick=True, out="/tmp/ls")      # -> results dict; files in /tmp/ls

* :mod:`.loss_sweep` -- ``ltp-lab loss-sweep``: point-to-point goodput vs random loss (Fig. 4/12)
* :mod:`.incast` -- ``ltp-lab incast``: batch synchronisation time, N workers -> one PS (Fig. 3/14)
* :mod:`.fairness` -- ``ltp-lab fairness``: one LTP flow vs one TCP flow on a shared link (Fig. 15)
* :mod:`.scoreboard` -- ``ltp-lab scoreboard``: issue 8's performance targets side by side, pass/fail
* :mod:`.schedules` -- ``ltp-lab schedules``: aggregation schedules in the lab beside the fluid simulator

Each module's top docstring is its theory of operation; ``docs/experiments.md`` has measured
tables and the command lines that produced them. :func:`register` adds all three subcommands
(``ltp_tools.cli`` lists this package in ``COMMAND_MODULES``).
"""
from __future__ import annotations

from . import incast, loss_sweep
from . import fairness
from . import scoreboard
from . import schedules

__all__ = ["loss_sweep", "incast", "fairness", "scoreboard", "schedules", "register"]


def register(subparsers) -> None:
    """Add the ``loss-sweep``, ``incast`` and ``fairness`` subcommands to ``ltp-lab``."""
    loss_sweep.register(subparsers)
    incast.register(subparsers)
    fairness.register(subparsers)
    scoreboard.register(subparsers)
    schedules.register(subparsers)
