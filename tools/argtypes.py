"""argparse value types of the ``ltp-bench`` / ``ltp-lab`` commands: a value out of range is refused by argparse
(exit 2, one line naming what the option means), never a traceback or a silent default."""

from __future__ import annotations

import argparse
import math

__all__ = ["number"]


def number(kind, lo, hi=None, *, what: str, open_lo: bool = False, open_hi: bool = False):
    """An argparse ``type``: a finite ``kind`` in ``[lo, hi]`` (``open_*``: the bound itself excluded), refused with
    a line that says what the option means (argparse exits 2, no traceback)."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {'whole ' if kind is int else ''}number ({what})") from None
        bad = (not math.isfinite(v) or v < lo or (open_lo and v == lo)
               or (hi is not None and (v > hi or (open_hi and v == hi))))
        if bad:
            rng = f"{'(' if open_lo else '['}{lo}, {'inf' if hi is None else hi}{')' if open_hi or hi is None else ']'}"
            raise argparse.ArgumentTypeError(f"{text} is out of range: {what} must be in {rng}")
        return v
    return parse
