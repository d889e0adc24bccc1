"""argparse value types shared by every ``ltp-ps`` command: bounded numbers refused with a message naming the fix."""

from __future__ import annotations

import argparse
import math


def bounded(kind, lo, what: str, fix: str = "", *, strict: bool = False, below=None):
    """An argparse ``type``: a finite ``kind`` (``int`` or ``float``) ``>= lo`` (``> lo`` when ``strict``),
    and ``< below`` when given.

    A refused value raises ``ArgumentTypeError`` saying ``<what> must be >= <lo> (<fix>)``, so argparse
    exits 2 with a line that names the option's meaning and how to set it."""
    bound = f"{'>' if strict else '>='} {lo}" + (f" and < {below}" if below is not None else "")
    tail = f" ({fix})" if fix else ""

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {'whole ' if kind is int else ''}number; "
                                             f"{what} must be {bound}{tail}") from None
        if not math.isfinite(v) or v < lo or (strict and v == lo) or (below is not None and v >= below):
            raise argparse.ArgumentTypeError(f"{text} is out of range: {what} must be {bound}{tail}")
        return v
    return parse


def model_name(text: str) -> str:
    """An argparse ``type`` for ``--model``: refused at parse time, before ``launch`` spawns anything."""
    from .errors import ConfigError
    from .model_names import synthetic_params

    try:
        synthetic_params(text)
        return text
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
