"""Guard: the compiled modules must be in use unless LTP_NO_EXTENSIONS asks for the twins."""

from __future__ import annotations

import importlib

import pytest

import ltp_ext

MODULES = ["wire", "udpio", "datapath"]


@pytest.mark.parametrize("name", MODULES)
def test_extension_built_and_selected(name):
    mod = ltp_ext.load(name)
    if ltp_ext.extensions_disabled():
        assert mod.__name__ == f"ltp_ext._{name}_py"
        return
    assert mod.__name__ == f"ltp_ext._{name}", (
        f"ltp_ext._{name} did not build; run `pip install -e .` with a C compiler "
        "(or set LTP_NO_EXTENSIONS=1 to test the pure-Python twin on purpose)")
    assert mod.__file__.endswith(".so")


@pytest.mark.parametrize("name", MODULES)
def test_twin_has_the_same_public_api(name):
    twin = importlib.import_module(f"ltp_ext._{name}_py")
    try:
        ext = importlib.import_module(f"ltp_ext._{name}")
    except ImportError:
        pytest.skip("extension not built (the guard test above fails in that case)")
    # every public function and class of the twin, and every public method of its classes
    for n in dir(twin):
        obj = getattr(twin, n)
        if n.startswith("_") or not callable(obj) or getattr(obj, "__module__", "") != twin.__name__:
            continue
        assert hasattr(ext, n), f"ltp_ext._{name} lacks {n} that its twin has"
        if isinstance(obj, type):
            for m in dir(obj):
                if not m.startswith("_") and callable(getattr(obj, m)):
                    assert hasattr(getattr(ext, n), m), f"ltp_ext._{name}.{n} lacks method {m}"
