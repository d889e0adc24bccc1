"""Run ``bench_allreduce`` on N lab hosts (one rank per network namespace) with loss, for gloo and ltp.

    sudo python -m ltp_ps.examples.lab_allreduce --ranks 4 --loss 0.01 --mb 100 --reps 3
    sudo python -m ltp_ps.examples.lab_allreduce --ranks 4 --loss 0.01 --mb 100 --ddp --modes gloo,ltp-hook
    sudo python -m ltp_ps.examples.lab_allreduce --ranks 4 --loss 0.01 --mb 100 --ddp --modes gloo,gloo-hook \
        --hook-schedule ring --pyspy /tmp/prof

Each rank runs in its own namespace of an ``ltp_tools.netlab.Lab`` whose
hosts drop ``--loss`` of their incoming data packets (and, with ``--rate``,
are rate-limited).  Modes: ``gloo`` and ``ltp`` (the backend, exact), and,
with ``--ddp``, ``gloo-hook`` (gloo backend + LTP gradient hook) and
``ltp-hook``; a mode may end in ``@LOSS`` to run at that loss instead of
``--loss`` (``gloo@0,ltp@0.01``); any other mode is refused before the lab is built.  ``--digits`` runs the DDP tutorial
(``ddp_digits``, ``--epochs``) instead of the benchmark and reports rank 0's
seconds to ``--target`` test accuracy.  ``--schedule`` / ``--hook-schedule`` choose the backend's and
the hook's reduction schedules.  ``--pyspy DIR`` samples rank 0 with py-spy
(collapsed stacks in ``DIR/<mode>.txt``).  Prints one ``RESULT`` JSON line per mode (rank 0's); exits
non-zero if any run failed or returned a wrong all-reduce.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from ltp_tools.netlab import Lab, check_support

RUN_TIMEOUT_S = 900  # seconds per mode
MASTER_PORT = 29511
BACKENDS = ("gloo", "ltp")


def parse_mode(mode: str) -> tuple[str, bool, float | None]:
    """``BACKEND[-hook][@LOSS]`` -> ``(backend, hook, loss or None)``; ValueError names what is wrong."""
    name, at, loss_text = mode.partition("@")
    backend, dash, suffix = name.partition("-")
    if backend not in BACKENDS or (dash and suffix != "hook"):
        raise ValueError(f"mode {mode!r}: expected BACKEND[-hook][@LOSS] with BACKEND one of {', '.join(BACKENDS)} "
                         f"(e.g. gloo, ltp-hook, ltp@0.01)")
    if not at:
        return backend, bool(dash), None
    try:
        loss = float(loss_text)
    except ValueError:
        loss = None
    if loss is None or not 0.0 <= loss < 1.0:
        raise ValueError(f"mode {mode!r}: the loss after '@' must be a number in [0, 1)")
    return backend, bool(dash), loss


def run_mode(lab: Lab, mode: str, parsed: tuple, args) -> dict:
    """One mode (``parsed``: what :func:`parse_mode` made of it) on every rank of the lab."""
    backend, hook, loss = parsed
    loss = args.loss if loss is None else loss
    for h in lab.hosts:
        lab.impair(h, "ingress", loss=loss, rate_bps=args.rate)
    procs = []
    for r, h in enumerate(lab.hosts[:args.ranks]):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(args.ranks),
                   MASTER_ADDR=lab.hosts[0].addr, MASTER_PORT=str(MASTER_PORT), OMP_NUM_THREADS="1",
                   LTP_BACKEND_HOST=h.addr, LTP_PS_HOST=h.addr, GLOO_SOCKET_IFNAME=h.ifname, LTP_PS_TRANSPORT="ltp")
        if args.digits:
            argv = [sys.executable, "-m", "ltp_ps.examples.ddp_digits", "--backend", backend, "--epochs",
                    str(args.epochs), "--target", str(args.target)]
            if not hook:
                argv.append("--no-hook")
        else:
            argv = [sys.executable, "-m", "ltp_ps.examples.bench_allreduce", "--backend", backend, "--mb",
                    str(args.mb), "--reps", str(args.reps), "--timeout", str(args.timeout)]
            if args.ddp:
                argv.append("--ddp")
            if hook:
                argv.append("--hook")
        if args.schedule:
            argv += ["--schedule", args.schedule]
        if args.hook_schedule:
            argv += ["--hook-schedule", args.hook_schedule]
        if args.pyspy and r == 0:
            os.makedirs(args.pyspy, exist_ok=True)
            argv = ["py-spy", "record", "-r", "100", "-f", "raw", "-o", os.path.join(args.pyspy, f"{mode}.txt"),
                    "--"] + argv
        procs.append(lab.popen(h, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=RUN_TIMEOUT_S) for p in procs]
    if any(p.returncode for p in procs):
        bad = [(r, p.returncode, o[1][-1500:]) for r, (p, o) in enumerate(zip(procs, outs)) if p.returncode]
        return {"mode": mode, "error": bad}
    line = [ln for ln in outs[0][0].splitlines() if ln.startswith("RESULT ")]
    res = json.loads(line[-1][7:])
    res.update(mode=mode, loss=loss, rate_bps=args.rate)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--loss", type=float, default=0.01)
    ap.add_argument("--rate", type=float, default=None, help="per-host rate limit, bit/s")
    ap.add_argument("--mb", type=float, default=100.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ddp", action="store_true")
    ap.add_argument("--modes", default="gloo,ltp")
    ap.add_argument("--schedule", default=None, help="the ltp backend's all-reduce schedule (auto|direct|ring|rsgcm)")
    ap.add_argument("--hook-schedule", default=None, help="the hook's schedule (auto|direct|ring|rsgcm)")
    ap.add_argument("--timeout", type=float, default=300.0, help="process group / hook timeout, seconds")
    ap.add_argument("--digits", action="store_true", help="run the DDP digits tutorial instead of the benchmark")
    ap.add_argument("--epochs", type=int, default=10, help="with --digits")
    ap.add_argument("--target", type=float, default=0.95, help="with --digits: test accuracy to time")
    ap.add_argument("--pyspy", default=None, help="directory for py-spy profiles of rank 0 (collapsed stacks)")
    args = ap.parse_args(argv)
    modes = []
    for mode in args.modes.split(","):
        try:
            modes.append((mode, parse_mode(mode)))
        except ValueError as exc:
            ap.error(str(exc))
    reason = check_support()
    if reason:
        print(f"cannot build the lab: {reason}", file=sys.stderr)
        return 2
    failed = False
    with Lab(n_hosts=args.ranks) as lab:
        for mode, parsed in modes:
            res = run_mode(lab, mode, parsed, args)
            print("RESULT " + json.dumps(res), flush=True)
            failed = failed or "error" in res or not res.get("correct", True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
