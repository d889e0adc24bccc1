"""``ltp_ps.quick_exit``: the command-line entry points exit with main's status, their output and ``atexit``
handlers intact, without the interpreter's teardown."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ltp_ps import quick_exit

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("code, rc", [(None, 0), (0, 0), (3, 3), (256 + 2, 2), (True, 1), ("bad thing", 1)])
def test_exit_code_is_what_sys_exit_would_give(code, rc, capsys):
    assert quick_exit.exit_code(code) == rc
    assert ("bad thing" in capsys.readouterr().err) == (code == "bad thing")


def _py(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("body, rc", [("return 4", 4), ("raise SystemExit(2)", 2), ("return None", 0),
                                      ("raise SystemExit('named failure')", 1)])
def test_run_exits_with_mains_status_after_atexit_and_with_buffered_output_flushed(body, rc):
    code = ("import atexit, sys\n"
            "from ltp_ps.quick_exit import run\n"
            "atexit.register(lambda: print('atexit ran'))\n"
            "def main():\n"
            "    sys.stdout.write('x' * 100000 + 'END')\n"  # more than one buffer, no newline: must be flushed
            f"    {body}\n"
            "run(main)\n"
            "print('not reached')\n")
    p = _py(code)
    assert p.returncode == rc, p.stderr
    assert p.stdout.startswith("x" * 100000 + "END") and p.stdout.endswith("atexit ran\n"), p.stdout[-80:]
    assert "not reached" not in p.stdout
    assert ("named failure" in p.stderr) == (rc == 1)


def test_an_exception_from_main_is_reported_as_usual():
    p = _py("from ltp_ps.quick_exit import run\n"
            "def main():\n"
            "    raise ValueError('boom')\n"
            "run(main)\n")
    assert p.returncode == 1 and "ValueError: boom" in p.stderr


def test_the_ltp_ps_command_exits_with_its_status_and_output():
    ok = subprocess.run([sys.executable, "-m", "ltp_ps.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "launch" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "ltp_ps.cli", "launch", "--lab", "off", "--workers", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--workers must be >= 1" in bad.stderr
