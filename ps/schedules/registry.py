"""Schedules by name.

Each schedule module under ``ltp_ps.schedules`` exposes ``SCHEDULE`` (its
:class:`~ltp_ps.schedules.base.Schedule` subclass).  Names are resolved
lazily, so a planner that is missing or fails to import makes only its own
name unavailable, with the reason in the error.
"""

from __future__ import annotations

import importlib

from ..errors import ConfigError

MODULES = {"direct": "direct", "ring": "ring", "rsgcm": "rsgcm", "mlfabric": "mlfabric", "rat": "rat",
           "hoplite": "hoplite"}


def _load(name: str):
    mod = importlib.import_module(f"ltp_ps.schedules.{MODULES[name]}")
    cls = getattr(mod, "SCHEDULE", None)
    if cls is None:
        raise ImportError(f"ltp_ps.schedules.{MODULES[name]} defines no SCHEDULE (its round-plan class) yet")
    return cls


def availability() -> dict:
    """``{name: None}`` for usable schedules, ``{name: reason}`` for the others."""
    out = {}
    for name in MODULES:
        try:
            _load(name)
            out[name] = None
        except Exception as exc:  # an unavailable planner must not break the others
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def available() -> list[str]:
    return [n for n, why in availability().items() if why is None]


def schedule_class(name: str):
    """The Schedule subclass called ``name``; a ConfigError listing what exists otherwise."""
    if name not in MODULES:
        raise ConfigError(f"unknown schedule {name!r}; schedules: {', '.join(MODULES)} "
                          f"(available now: {', '.join(available())})")
    try:
        return _load(name)
    except Exception as exc:
        raise ConfigError(f"schedule {name!r} is not available in this install ({type(exc).__name__}: {exc}); "
                          f"available now: {', '.join(available())}") from None


def create(name: str, world, **kw):
    """Instantiate schedule ``name`` for ``world``."""
    cls = schedule_class(name)
    if cls.needs_servers and not world.shards:
        raise ConfigError(f"schedule {name!r} needs PS shards (--num-servers >= 1)")
    return cls(world, **kw)
