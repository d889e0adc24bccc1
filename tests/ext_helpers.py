"""Loading an ``ltp_ext`` module in the tests that run against both implementations."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def compiled(name: str) -> ModuleType:
    """``ltp_ext._<name>``, the compiled module. Missing, it skips the test only where ``LTP_NO_EXTENSIONS`` is set
    (the twins' CI run); anywhere else a missing extension fails it, so a build that silently fell back to the
    twins cannot pass as tested."""
    try:
        return importlib.import_module(f"ltp_ext._{name}")
    except ImportError as exc:
        if os.environ.get("LTP_NO_EXTENSIONS", "") not in ("", "0"):
            pytest.skip(f"compiled ltp_ext._{name} missing and LTP_NO_EXTENSIONS is set ({exc})")
        pytest.fail(f"compiled ltp_ext._{name} did not build: {exc}; run `python setup.py build_ext --inplace`")


def implementation(name: str, which: str) -> ModuleType:
    """``which`` = ``"compiled"`` (:func:`compiled`) or ``"twin"`` (``ltp_ext._<name>_py``)."""
    return compiled(name) if which == "compiled" else importlib.import_module(f"ltp_ext._{name}_py")
