"""Compiled hot paths of LTP, each with a pure-Python twin.

Every module ``ltp_ext/_<name>.pyx`` has a twin ``ltp_ext/_<name>_py.py`` with
the same functions, classes and exceptions. :func:`load` picks the compiled one
unless ``LTP_NO_EXTENSIONS=1`` is set or it did not build. Tests run against
both and ``tests/test_ext_guard.py`` fails if the extension silently did not
build.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

__all__ = ["load", "extensions_disabled", "loaded"]

#: name -> True when the compiled module is in use, False for the twin.
loaded: dict[str, bool] = {}


def extensions_disabled() -> bool:
    """True when ``LTP_NO_EXTENSIONS`` asks for the pure-Python twins."""
    return os.environ.get("LTP_NO_EXTENSIONS", "") not in ("", "0")


def load(name: str) -> ModuleType:
    """Return ``ltp_ext._<name>`` (compiled) or its twin ``ltp_ext._<name>_py``."""
    if not extensions_disabled():
        try:
            mod = importlib.import_module(f"ltp_ext._{name}")
        except ImportError:
            pass
        else:
            loaded[name] = True
            return mod
    loaded[name] = False
    return importlib.import_module(f"ltp_ext._{name}_py")
