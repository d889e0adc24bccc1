"""Process entry points that skip the interpreter's teardown.

A PS, worker, store or launcher process imports torch. Once its ``main`` has returned, everything it opened
is closed (transports, the lab, metrics files, child processes), and what is left is the interpreter's own
teardown: module clean-up and a last garbage collection over torch's hundreds of thousands of objects, 0.5-1.5 s
of CPU per process. A job pays it in every process at its end, on the path to the launch's exit status (on two
cores, five processes' teardown is seconds). :func:`run` instead runs the ``atexit`` handlers (logging's flush,
the launcher's temporary files), flushes stdout and stderr and leaves with ``os._exit``.

:func:`run` also freezes what the imports allocated (``gc.freeze``): later collections skip torch's module
objects instead of walking them again every time.

Only the command-line entry points use it; ``main`` functions called in-process (tests) return as before.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
from typing import Callable


def exit_code(code) -> int:
    """The process exit status ``sys.exit(code)`` would give (a non-int code is printed, status 1)."""
    if code is None:
        return 0
    if isinstance(code, bool) or not isinstance(code, int):
        print(code, file=sys.stderr)
        return 1
    return code & 0xFF


def run(main: Callable[[], object]) -> None:
    """Run ``main()`` and exit the process with its return value as the status, without the interpreter's
    teardown. An exception other than ``SystemExit`` propagates (the interpreter prints it and exits 1 as usual)."""
    gc.freeze()
    try:
        code = main()
    except SystemExit as exc:
        code = exc.code
    rc = exit_code(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or replaced stream: nothing left to write
            pass
    os._exit(rc)
