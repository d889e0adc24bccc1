"""argparse value types shared by every ``ltp-ps`` command: bounded numbers refused with a message naming the fix."""

from __future__ import annotations

import argparse
import math


def _checked(kind, text: str, in_range, *, not_number: str, out_of_range: str):
    """``kind(text)`` if it is finite and ``in_range``; else ``ArgumentTypeError``: ``<text> is not a number`` +
    ``not_number``, or ``<text> is out of range`` + ``out_of_range``."""
    try:
        v = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a {'whole ' if kind is int else ''}number"
                                         f"{not_number}") from None
    if not math.isfinite(v) or not in_range(v):
        raise argparse.ArgumentTypeError(f"{text} is out of range{out_of_range}")
    return v


def bounded(kind, lo, what: str, fix: str = "", *, strict: bool = False, below=None):
    """An argparse ``type``: a finite ``kind`` (``int`` or ``float``) ``>= lo`` (``> lo`` when ``strict``),
    and ``< below`` when given.

    A refused value raises ``ArgumentTypeError`` saying ``<what> must be >= <lo> (<fix>)``, so argparse
    exits 2 with a line that names the option's meaning and how to set it."""
    bound = f"{'>' if strict else '>='} {lo}" + (f" and < {below}" if below is not None else "")
    tail = f" ({fix})" if fix else ""

    def in_range(v):
        return (v > lo if strict else v >= lo) and (below is None or v < below)
    return lambda text: _checked(kind, text, in_range, not_number=f"; {what} must be {bound}{tail}",
                                 out_of_range=f": {what} must be {bound}{tail}")


def number(kind, lo, hi=None, *, what: str, open_lo: bool = False, open_hi: bool = False):
    """An argparse ``type``: a finite ``kind`` in ``[lo, hi]`` (``open_*``: the bound itself excluded), refused with
    a line that says what the option means (argparse exits 2, no traceback): the ``ltp-bench`` / ``ltp-lab``
    commands' form of :func:`bounded`."""
    rng = f"{'(' if open_lo else '['}{lo}, {'inf' if hi is None else hi}{')' if open_hi or hi is None else ']'}"

    def in_range(v):
        return (v > lo if open_lo else v >= lo) and (hi is None or (v < hi if open_hi else v <= hi))
    return lambda text: _checked(kind, text, in_range, not_number=f" ({what})",
                                 out_of_range=f": {what} must be in {rng}")


def model_name(text: str) -> str:
    """An argparse ``type`` for ``--model``: refused at parse time, before ``launch`` spawns anything."""
    from .errors import ConfigError
    from .model_names import check_model_name

    try:
        return check_model_name(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
