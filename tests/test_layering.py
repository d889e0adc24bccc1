"""Layering rules of issue 8: ``ltp_ext`` imports nothing from ``ltp``; regimes are named once.

The first rule is checked twice: statically (no import statement in any
``ltp_ext`` source names ``ltp``) and at run time (importing every kernel, the
compiled one and its twin, leaves ``ltp`` out of ``sys.modules``).
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXT = ROOT / "ltp_ext"
_IMPORT_LTP = re.compile(r"^\s*(from\s+ltp(\.|\s)|import\s+ltp(\.|\s|$|,))", re.M)


def _sources():
    return sorted(p for p in EXT.iterdir() if p.suffix in (".py", ".pyx", ".pyi", ".pxd"))


def test_the_import_pattern_catches_what_it_must():
    for bad in ("from ltp.errors import WireError", "import ltp", "from ltp import wire", "  import ltp.wire"):
        assert _IMPORT_LTP.search(bad), bad
    for ok in ("from ltp_ext.errors import WireError", "import ltp_ext", "from .errors import X", "# ltp.errors"):
        assert not _IMPORT_LTP.search(ok), ok


@pytest.mark.parametrize("path", _sources(), ids=lambda p: p.name)
def test_ltp_ext_sources_do_not_import_ltp(path):
    hits = [m.group(0).strip() for m in _IMPORT_LTP.finditer(path.read_text())]
    assert not hits, f"{path.name} imports from ltp ({hits}); move the shared name into ltp_ext or pass it in"


def test_importing_every_kernel_loads_no_ltp_module():
    code = ("import importlib, sys\n"
            "for name in ('wire', 'udpio', 'datapath'):\n"
            "    importlib.import_module('ltp_ext._' + name + '_py')\n"
            "    try:\n"
            "        importlib.import_module('ltp_ext._' + name)\n"
            "    except ImportError:\n"
            "        pass\n"
            "bad = sorted(m for m in sys.modules if m == 'ltp' or m.startswith('ltp.'))\n"
            "assert not bad, bad\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_ltp_errors_are_the_kernels_errors():
    import ltp.errors
    import ltp_ext.errors
    from ltp_ext import load

    assert ltp.errors.WireError is ltp_ext.errors.WireError is load("wire").WireError
    assert ltp.errors.LocalProtocolError is load("datapath").LocalProtocolError
    assert issubclass(ltp.errors.TransferRefused, ltp.errors.LTPError)


def test_reorder_threshold_is_named_once_and_used_by_both_kernels():
    import ltp_ext._datapath_py as twin
    from ltp_ext.constants import PACKET_REORDER_THRESHOLD

    assert twin.PACKET_REORDER_THRESHOLD == PACKET_REORDER_THRESHOLD == 3
    for name in ("_datapath_py.py", "_datapath.pyx"):
        text = (EXT / name).read_text()
        assert "_detect(3," not in text and "PACKET_REORDER_THRESHOLD" in text, name
