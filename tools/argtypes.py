"""argparse value types of the ``ltp-bench`` / ``ltp-lab`` commands: a value out of range is refused by argparse
(exit 2, one line naming what the option means), never a traceback or a silent default.  The one implementation
lives in :mod:`ltp_ps.argtypes`, beside the ``ltp-ps`` commands' form."""

from __future__ import annotations

from ltp_ps.argtypes import number

__all__ = ["number"]
