"""``python -m ltp_tools.stress``: run the main job and the fairness experiment many times and report
every abnormal exit with its faulthandler stack (issue 7, section 7: the rare SIGSEGV).

Theory of operation
    Each run is a fresh process tree in its own session, started with ``PYTHONFAULTHANDLER=1``,
    which every child inherits (launcher, PS, workers, the lab's roles), so a fatal signal in any
    of them prints that process's Python stacks on its stderr; the launcher and the experiment
    pass their children's output through, and this tool keeps all of a run's output in one log
    file. A run is *abnormal* when its exit status is not 0 (negative: killed by a signal), when
    it outlives ``--timeout`` (then the whole process group gets SIGABRT, so faulthandler dumps
    every thread of every process before it dies, and the lab is cleaned), or when its output
    holds a crash marker (``Fatal Python error``, ``Segmentation fault``, ``Exception ignored in
    tp_clear``, a child that died by a signal). The report names each abnormal run: job, exit
    status and signal, markers, the faulthandler stacks cut out of the log, and the log's path.

    ``--debug-alloc`` runs every process under ``PYTHONMALLOC=debug`` and ``PYTHONDEVMODE=1``
    (``-X dev``): a use-after-free or a buffer overrun then fails at once, deterministically,
    with a stack, instead of corrupting memory that crashes later. ``--debug-tests`` first runs
    the compiled modules' tests that way (``tests/test_datapath.py tests/test_udpio.py
    tests/test_wire_ext.py``).

    Exit status: 0 when every run was clean, 1 otherwise (never success on failure).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["RunResult", "find_markers", "extract_stacks", "classify", "main"]

#: seconds a timed-out run's processes get to print their faulthandler stacks after SIGABRT
ABORT_GRACE_S = 5.0
#: most lines kept per extracted stack
STACK_LINES = 120

_MARKERS = [
    ("fatal_python_error", re.compile(r"^Fatal Python error: .*", re.M)),
    ("segfault", re.compile(r"Segmentation fault", re.M)),
    ("tp_clear", re.compile(r"^Exception ignored in tp_clear.*", re.M)),
    # the launcher's words for a child that died by a signal; a raw negative return code
    ("child_signal", re.compile(r"was killed by SIG[A-Z]+|killed by signal \d+|exited with code -\d+", re.M)),
    ("debug_alloc", re.compile(r"^Debug memory block at address .*|bad ID: Allocated using API", re.M)),
]
_STACK_START = re.compile(r"^(Fatal Python error: .*|Exception ignored in tp_clear.*|Current thread 0x[0-9a-f]+.*|"
                          r"Thread 0x[0-9a-f]+.*|Debug memory block at address .*)$")
_STACK_BODY = re.compile(r"^(\s+File .*|\s+<.*>|\s*$|Current thread 0x.*|Thread 0x.*|Python runtime state: .*|"
                         r"Extension modules: .*|\s+.*|[A-Za-z]+Error: .*|Traceback .*)$")

_PY = sys.executable
_LAUNCH = "import sys; from ltp_ps.cli import main; sys.exit(main(sys.argv[1:]))"
_LAB = "import sys; from ltp_tools.cli import main; sys.exit(main(sys.argv[1:]))"


@dataclass
class RunResult:
    """One run of one job."""

    index: int
    job: str
    returncode: int | None
    duration_s: float
    timed_out: bool
    log: str
    abnormal: bool = False
    signal: str | None = None
    markers: list = field(default_factory=list)
    stacks: list = field(default_factory=list)


def find_markers(text: str) -> list:
    """Names and first lines of the crash markers in ``text``."""
    found = []
    for name, rx in _MARKERS:
        m = rx.search(text)
        if m:
            found.append(f"{name}: {m.group(0).strip()[:200]}")
    return found


def extract_stacks(text: str, limit: int = 8) -> list:
    """Cut faulthandler / tp_clear / debug-allocator reports out of a log (at most ``limit``)."""
    lines = text.splitlines()
    out = []
    i = 0
    while i < len(lines) and len(out) < limit:
        if _STACK_START.match(lines[i]):
            block = [lines[i]]
            j = i + 1
            while j < len(lines) and len(block) < STACK_LINES and (_STACK_BODY.match(lines[j]) or
                                                                    _STACK_START.match(lines[j])):
                block.append(lines[j])
                j += 1
            while block and not block[-1].strip():
                block.pop()
            out.append("\n".join(block))
            i = j
        else:
            i += 1
    return out


def _signal_name(rc: int | None) -> str | None:
    if rc is None:
        return None
    num = -rc if rc < 0 else (256 - rc if rc > 128 and 256 - rc < 65 else None)
    if num is None:
        return None
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def classify(res: RunResult, text: str) -> RunResult:
    """Fill in ``abnormal``, ``signal``, ``markers`` and ``stacks`` from the exit status and the log."""
    res.markers = find_markers(text)
    res.stacks = extract_stacks(text)
    res.signal = _signal_name(res.returncode)
    res.abnormal = res.timed_out or res.returncode != 0 or bool(res.markers)
    return res


def job_command(job: str, args, index: int, out_dir: Path) -> list:
    """The command line of one run of ``job``."""
    if job == "main":
        cmd = [_PY, "-c", _LAUNCH, "launch", "--transport", "ltp", "--workers", str(args.workers), "--model", "digits",
               "--epochs", str(args.epochs), "--seed", str(index)]
        if args.loss:
            cmd += ["--loss", str(args.loss)]
        return cmd
    if job == "fairness":
        return [_PY, "-c", _LAB, "fairness", "--quick", "--ccs", args.fairness_ccs, "--seed", str(index),
                "--no-progress", "--out", str(out_dir / f"fairness-{index:04d}")]
    raise ValueError(f"unknown job {job!r}: use main or fairness")


def _env(debug_alloc: bool) -> dict:
    env = dict(os.environ, PYTHONFAULTHANDLER="1", PYTHONUNBUFFERED="1")
    if debug_alloc:
        env.update(PYTHONMALLOC="debug", PYTHONDEVMODE="1")
    return env


def run_one(job: str, cmd: list, index: int, log_path: Path, timeout: float, debug_alloc: bool) -> RunResult:
    """Run ``cmd`` in its own session; on timeout SIGABRT the group (faulthandler dumps stacks)."""
    t0 = time.monotonic()
    timed_out = False
    with open(log_path, "wb") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(debug_alloc),
                                start_new_session=True)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _signal_group(proc.pid, signal.SIGABRT)
            try:
                rc = proc.wait(ABORT_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                rc = proc.wait()
    res = RunResult(index=index, job=job, returncode=rc, duration_s=round(time.monotonic() - t0, 2),
                    timed_out=timed_out, log=str(log_path))
    return classify(res, log_path.read_text(errors="replace"))


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _clean_lab() -> None:
    subprocess.run([_PY, "-c", _LAB, "clean"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120,
                   check=False)


def debug_tests(out_dir: Path, timeout: float) -> RunResult:
    """The compiled modules' tests under the debug allocator and dev mode."""
    cmd = [_PY, "-X", "dev", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_datapath.py",
           "tests/test_udpio.py", "tests/test_wire_ext.py"]
    return run_one("debug-tests", cmd, 0, out_dir / "debug-tests.log", timeout, debug_alloc=True)


def schedule(args) -> list:
    """Which job each run is: ``main``, with ``fairness`` every ``--fairness-every``-th run."""
    jobs = []
    for i in range(args.runs):
        if args.fairness_every and (i + 1) % args.fairness_every == 0:
            jobs.append("fairness")
        else:
            jobs.append("main" if not args.no_main else "fairness")
    return jobs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ltp_tools.stress", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=50, help="how many runs in all (default 50)")
    p.add_argument("--epochs", type=int, default=15, help="epochs of the main job (default 15, the README's)")
    p.add_argument("--workers", type=int, default=4, help="workers of the main job (default 4)")
    p.add_argument("--loss", type=float, default=0.01,
                   help="--loss of the main job (default 0.01; needs the lab: root and namespaces; 0 = loopback)")
    p.add_argument("--fairness-every", type=int, default=5,
                   help="every K-th run is the fairness experiment (--quick); 0 = never (default 5)")
    p.add_argument("--fairness-ccs", default="cubic", help="TCP variants of the fairness runs (default cubic)")
    p.add_argument("--no-main", action="store_true", help="run only the fairness experiment")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a run is aborted (default 600)")
    p.add_argument("--debug-alloc", action="store_true",
                   help="every process under PYTHONMALLOC=debug and PYTHONDEVMODE=1")
    p.add_argument("--debug-tests", action="store_true",
                   help="first run the compiled modules' tests under PYTHONMALLOC=debug -X dev")
    p.add_argument("--out", default=None, help="directory for logs and report.json (default ./results/stress-<time>)")
    p.add_argument("--stop-on-failure", action="store_true", help="stop at the first abnormal run")
    return p


def _print_result(r: RunResult, out) -> None:
    state = "ABNORMAL" if r.abnormal else "ok"
    sig = f" ({r.signal})" if r.signal else ""
    to = " TIMEOUT" if r.timed_out else ""
    print(f"[stress] run {r.index:3d} {r.job:11s} rc={r.returncode}{sig}{to} {r.duration_s:7.1f} s  {state}",
          file=out, flush=True)
    if r.abnormal:
        for m in r.markers:
            print(f"           marker: {m}", file=out)
        for s in r.stacks:
            print("           stack:\n" + "\n".join("             " + ln for ln in s.splitlines()), file=out)
        print(f"           log: {r.log}", file=out, flush=True)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.runs < 0 or args.epochs <= 0 or args.workers <= 0 or args.timeout <= 0 or args.fairness_every < 0:
        raise SystemExit("--runs >= 0, --epochs/--workers/--timeout > 0 and --fairness-every >= 0, please")
    out_dir = Path(args.out or f"results/stress-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    t0 = time.monotonic()
    if args.debug_tests:
        r = debug_tests(out_dir, args.timeout)
        _print_result(r, sys.stdout)
        results.append(r)
    for i, job in enumerate(schedule(args)):
        cmd = job_command(job, args, i, out_dir)
        r = run_one(job, cmd, i, out_dir / f"{job}-{i:04d}.log", args.timeout, args.debug_alloc)
        if r.timed_out:
            _clean_lab()
        _print_result(r, sys.stdout)
        results.append(r)
        (out_dir / "report.json").write_text(json.dumps([asdict(x) for x in results], indent=1))
        if r.abnormal and args.stop_on_failure:
            break
    bad = [r for r in results if r.abnormal]
    by_job: dict = {}
    for r in results:
        d = by_job.setdefault(r.job, {"runs": 0, "abnormal": 0, "signals": 0, "timeouts": 0})
        d["runs"] += 1
        d["abnormal"] += r.abnormal
        d["signals"] += r.signal is not None
        d["timeouts"] += r.timed_out
    summary = {"runs": len(results), "abnormal": len(bad), "by_job": by_job,
               "wall_s": round(time.monotonic() - t0, 1), "debug_alloc": args.debug_alloc, "out": str(out_dir)}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"[stress] {json.dumps(summary)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
