"""Shared plumbing of the ``ltp-lab`` experiments: arguments, output files, tables, plots.

Theory of operation
    Every experiment module (``loss_sweep``, ``incast``, ``fairness``) has the same shape:
    ``run(**params) -> dict`` does the measurement and writes its files; ``register`` adds
    an ``ltp-lab`` subcommand whose ``_cli`` turns the arguments into ``run`` parameters.
    This module holds what they share:

    * :func:`add_common_args` -- ``--repeats``, ``--seed``, ``--quick``, ``--out``;
    * :func:`out_dir` -- ``./results/<name>-<UTC timestamp>`` unless ``--out`` is given;
    * :func:`write_results` -- ``results.json`` (parameters, environment, every row, the
      summary) and one or more CSV files with fixed column lists (a missing value is an
      empty cell, never a silently dropped column);
    * :func:`format_table` -- the fixed-width summary table printed at the end;
    * :func:`pyplot` -- matplotlib with the Agg backend (no display needed);
    * :func:`require_lab` -- a clear error when namespaces are unavailable.

    Child processes inside the namespaces print one JSON object per line; :func:`read_json_lines`
    collects them and raises with the child's stderr when one fails, so an error in a worker
    reads like an error, not like a hang.
"""
from __future__ import annotations

from ltp_tools.argtypes import number

import argparse
import csv
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from typing import Iterable, Sequence

RESULTS_ROOT = "results"


class ExperimentError(RuntimeError):
    """An experiment could not produce a result; the message says what failed and how to fix it."""


def add_common_args(p: argparse.ArgumentParser) -> None:
    """The arguments every experiment takes."""
    p.add_argument("--repeats", type=number(int, 1, what="measurements per point"), default=None,
                   help="measurements per point (default: 3, or 1 with --quick)")
    p.add_argument("--seed", type=int, default=1,
                   help="seeds the LTP endpoints' RNG and the message contents (the kernel's random "
                        "drops are not seedable)")
    p.add_argument("--quick", action="store_true",
                   help="CI profile: small sizes and few points, well under a minute")
    p.add_argument("--out", default=None, help="output directory (default ./results/<name>-<timestamp>)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")


def out_dir(name: str, out: str | None) -> str:
    """Create and return the output directory."""
    if out is None:
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
        out = os.path.join(RESULTS_ROOT, f"{name}-{stamp}")
    os.makedirs(out, exist_ok=True)
    return out


def require_lab() -> None:
    """Raise :class:`~ltp_tools.netlab.LabUnsupported` with the fix when namespaces cannot be made."""
    from ltp_tools.netlab import LabUnsupported, check_support

    problem = check_support()
    if problem:
        raise LabUnsupported(f"{problem} (the experiments need the network lab; run `ltp-lab check`)")


def environment() -> dict:
    """What the numbers were measured on (they drift with load: compare side by side only)."""
    import ltp

    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return dict(host=platform.node(), kernel=platform.release(), python=platform.python_version(),
                cpus=os.cpu_count(), loadavg_at_start=load, ltp_extensions=ltp.using_extensions(),
                utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))


def write_csv(path: str, columns: Sequence[str], rows: Iterable[dict]) -> None:
    """Write ``rows`` with exactly ``columns`` (missing values as empty cells)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in columns})


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=_json_default)
        f.write("\n")


def _json_default(o):
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def format_table(columns: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A plain fixed-width table (also valid Markdown)."""
    cells = [[_fmt(v) for v in r] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    line = lambda vals: "| " + " | ".join(v.rjust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    out = [line(list(columns)), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells]
    return "\n".join(out)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:
            return "nan"
        return f"{v:.4g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def progress(total: int, desc: str, disable: bool = False):
    """A tqdm bar on stderr."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="run", disable=disable, file=sys.stderr, dynamic_ncols=True)


def read_json_lines(p: subprocess.Popen, timeout: float, what: str) -> list[dict]:
    """Wait for ``p`` and return the JSON objects it printed, one per line; raise with stderr on failure."""
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise ExperimentError(f"{what} did not finish within {timeout:.0f} s; stderr tail:\n{(err or '')[-1500:]}")
    objs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not objs:
        raise ExperimentError(f"{what} failed (exit {p.returncode}); stderr tail:\n{(err or '')[-1500:]}")
    return objs


def wait_ready(p: subprocess.Popen, timeout: float, what: str) -> None:
    """Block until ``p`` prints ``READY`` on stdout (:func:`ltp_tools.ready.wait_ready`, raising
    :class:`ExperimentError`)."""
    from ltp_tools.ready import wait_ready as _wait

    _wait(p, timeout, what, ExperimentError)


def percentile(xs: Sequence[float], q: float) -> float:
    """q-th percentile (0..100) by linear interpolation; nan for no data."""
    import numpy as np

    return float(np.percentile(np.asarray(xs, float), q)) if len(xs) else float("nan")


def parse_list(text: str, conv=float) -> list:
    """'0,0.01,0.1' -> [0.0, 0.01, 0.1]."""
    try:
        return [conv(x) for x in str(text).split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bad list {text!r}: {e}") from None
