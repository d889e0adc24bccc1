"""``ltp-lab``: command-line front end of the network lab (``main(argv=None)``).

Built-in subcommands: ``check``, ``up``, ``list``, ``exec``, ``down``, ``clean``, ``dissect``.

Adding subcommands (experiments such as loss-sweep, incast, fairness)
    Write a module with a function ``register(subparsers)`` that adds one or more parsers
    with ``subparsers.add_parser(...)`` and sets ``parser.set_defaults(func=run)``, where
    ``run(args) -> int`` returns the exit status. Then either append the module's import
    path to :data:`COMMAND_MODULES` below, or call :func:`register_module` before
    :func:`main` (e.g. from a test or another entry point). Example::

        # tools/experiments/loss_sweep.py
        def register(subparsers):
            p = subparsers.add_parser("loss-sweep", help="goodput vs loss, LTP vs TCP")
            p.add_argument("--losses", default="0,0.001,0.01")
            p.set_defaults(func=run)

        def run(args) -> int:
            ...
            return 0

State of persistent labs (``up``) lives in ``$LTP_LAB_STATE`` (default ``/run/ltp-lab``) as
``NAME.json``; the namespaces are ``ltplab-NAME-sw`` and ``ltplab-NAME-hI``.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
from typing import Callable

#: import paths of modules whose ``register(subparsers)`` adds subcommands (built-ins first)
COMMAND_MODULES: list[str] = ["ltp_tools.cli"]
COMMAND_MODULES.append("ltp_tools.experiments")  # loss-sweep, incast, fairness (tools/experiments/)
COMMAND_MODULES.append("ltp_tools.experiments.accuracy_grid")  # accuracy-grid (issue 7)
_extra_registrars: list[Callable] = []

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_]{0,15}$")


def register_module(module_or_registrar) -> None:
    """Add subcommands from a module (import path or module object) or a ``register`` callable."""
    if callable(module_or_registrar):
        _extra_registrars.append(module_or_registrar)
    elif isinstance(module_or_registrar, str):
        COMMAND_MODULES.append(module_or_registrar)
    else:
        _extra_registrars.append(module_or_registrar.register)


def state_dir() -> str:
    from ltp_tools.netlab.support import state_dir as lab_state_dir

    return lab_state_dir()


def _state_path(name: str) -> str:
    return os.path.join(state_dir(), f"{name}.json")


def _load_state(name: str) -> dict:
    try:
        with open(_state_path(name)) as f:
            return json.load(f)
    except FileNotFoundError:
        raise SystemExit(f"ltp-lab: no lab named {name!r} (state {_state_path(name)} missing); "
                         f"see `ltp-lab list`") from None


# --------------------------------------------------------------------------- built-in commands
def cmd_check(args) -> int:
    from ltp_tools.netlab import check_support, delay_backend, probe

    problem = check_support()
    if problem:
        print(f"NOT USABLE: {problem}")
        return 1
    p = probe()
    backend = delay_backend()
    print("network lab: usable")
    print(f"  tbf (rate): {'yes' if p.get('tbf') else 'no'}")
    print(f"  netem: {'yes' if p.get('netem') else 'no (delay via the NFQUEUE C delayer)'}")
    print(f"  iptables-legacy NFQUEUE: {'yes' if p.get('nfqueue') else 'no: ' + p.get('nfqueue_error', '')}")
    print(f"  gcc + libnetfilter_queue: {'yes' if p.get('gcc') and p.get('libnetfilter_queue') else 'no'}")
    print(f"  delay backend: {backend}")
    if backend == "none":
        from ltp_tools.netlab.support import delay_unavailable_reason
        print(f"  WARNING: {delay_unavailable_reason()}")
    from ltp_tools.tcpbench import available_cc
    print(f"  TCP congestion controls: {' '.join(available_cc())}")
    return 0


def cmd_up(args) -> int:
    from ltp_tools.netlab import Lab

    if not NAME_RE.match(args.name):
        print(f"ltp-lab: lab name must match {NAME_RE.pattern}", file=sys.stderr)
        return 2
    if os.path.exists(_state_path(args.name)):
        print(f"ltp-lab: lab {args.name!r} is already up; `ltp-lab down {args.name}` first", file=sys.stderr)
        return 1
    racks = [int(x) for x in args.racks.split(",")] if args.racks else None
    lab = Lab(n_hosts=args.hosts, racks=racks, prefix=f"ltplab-{args.name}", mtu=args.mtu, persistent=True,
              gro=args.gro)
    lab.start()
    try:
        if any([args.loss, args.rate, args.delay]):
            for h in lab.hosts:
                lab.impair(h, "ingress", loss=args.loss, rate_bps=args.rate, queue_bytes=args.queue,
                           delay_s=args.delay, jitter_s=args.jitter)
        os.makedirs(state_dir(), exist_ok=True)
        state = lab.describe()
        state["name"] = args.name
        state["impairment"] = dict(loss=args.loss, rate_bps=args.rate, queue_bytes=args.queue,
                                   delay_s=args.delay, jitter_s=args.jitter)
        with open(_state_path(args.name), "w") as f:
            json.dump(state, f, indent=1)
    except BaseException:
        lab.close()
        raise
    print(f"lab {args.name} up ({state['backend']}); switch namespace {lab.switch_ns}")
    for h in lab.hosts:
        print(f"  {h.name}  {h.addr:<15} netns {h.netns}  rack {h.rack}")
    print(f"run `ltp-lab exec {args.name} h0 -- CMD...`; remove with `ltp-lab down {args.name}`")
    return 0


def cmd_list(args) -> int:
    d = state_dir()
    names = sorted(f[:-5] for f in os.listdir(d) if f.endswith(".json")) if os.path.isdir(d) else []
    for name in names:
        st = _load_state(name)
        print(f"{name}: " + ", ".join(f"{h['name']}={h['addr']}" for h in st["hosts"]))
    return 0


def cmd_exec(args) -> int:
    st = _load_state(args.name)
    argv = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd
    if not argv:
        print("ltp-lab exec: no command given (ltp-lab exec NAME HOST -- CMD...)", file=sys.stderr)
        return 2
    for h in st["hosts"]:
        if args.host in (h["name"], h["addr"], h["netns"]):
            return subprocess.call(["ip", "netns", "exec", h["netns"], *argv])
    print(f"ltp-lab exec: no host {args.host!r} in lab {args.name} "
          f"(hosts: {', '.join(h['name'] for h in st['hosts'])})", file=sys.stderr)
    return 2


def cmd_down(args) -> int:
    from ltp_tools.netlab import clean

    st = _load_state(args.name)
    removed = clean(st["prefix"] + "-")
    os.unlink(_state_path(args.name))
    print(f"lab {args.name} down; removed {len(removed)} namespaces")
    return 0


def cmd_clean(args) -> int:
    from ltp_tools.netlab import clean
    from ltp_tools.netlab.support import in_use

    busy = {} if args.force else in_use(args.prefix)
    removed = clean(args.prefix, force=args.force)
    for n in removed:
        print(f"removed namespace {n}")
    for lab, pid in sorted(busy.items()):
        print(f"kept lab {lab}: process {pid} is running it (--force removes it anyway)")
    d = state_dir()
    if os.path.isdir(d):
        for f in os.listdir(d):
            if f.endswith(".json"):
                try:
                    with open(os.path.join(d, f)) as fh:
                        prefix = json.load(fh).get("prefix", "")
                except (OSError, ValueError):
                    prefix = ""
                if prefix.startswith(args.prefix) or not prefix:
                    os.unlink(os.path.join(d, f))
                    print(f"removed state {f}")
    if not removed and not busy:
        print(f"nothing left with prefix {args.prefix!r}")
    return 0


def cmd_dissect(args) -> int:
    from ltp_tools.dissector import dissect_pcap

    stats: dict = {}
    n = dissect_pcap(args.pcap, port=args.port, stats=stats)
    print(f"{n} LTP packets ({stats['malformed']} malformed)", file=sys.stderr)
    return 0


def register(subparsers) -> None:
    """Register the built-in subcommands."""
    from ltp_tools.netlab import DEFAULT_PREFIX

    p = subparsers.add_parser("check", help="is the lab usable here? which backend?")
    p.set_defaults(func=cmd_check)

    p = subparsers.add_parser("up", help="create a named lab that persists until `down`")
    p.add_argument("name")
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--racks", help="two tiers, e.g. 2,2 (overrides --hosts)")
    p.add_argument("--mtu", type=int, default=1500)
    p.add_argument("--loss", type=float, default=0.0, help="drop probability at every host's ingress")
    p.add_argument("--rate", type=float, default=None, help="downlink rate of every host, bit/s")
    p.add_argument("--queue", type=int, default=None, help="downlink queue, bytes")
    p.add_argument("--delay", type=float, default=0.0, help="one-way delay into every host, s")
    p.add_argument("--jitter", type=float, default=0.0, help="uniform jitter, s")
    p.add_argument("--gro", action="store_true",
                   help="receive GRO on every host's interface, as a NIC driver does (loss moves to the switch)")
    p.set_defaults(func=cmd_up)

    p = subparsers.add_parser("list", help="list labs created with `up`")
    p.set_defaults(func=cmd_list)

    p = subparsers.add_parser("exec", help="run a command inside a host: exec NAME HOST -- CMD...")
    p.add_argument("name")
    p.add_argument("host", help="h0, h1, ... or an address")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_exec)

    p = subparsers.add_parser("down", help="remove a lab created with `up`")
    p.add_argument("name")
    p.set_defaults(func=cmd_down)

    p = subparsers.add_parser("clean", help="remove every namespace (and state) with the prefix, "
                                             "except labs a live process is running")
    p.add_argument("--prefix", default=DEFAULT_PREFIX)
    p.add_argument("--force", action="store_true", help="also remove labs that a live process is running")
    p.set_defaults(func=cmd_clean)

    p = subparsers.add_parser("dissect", help="print one line per LTP packet of a pcap")
    p.add_argument("pcap")
    p.add_argument("--port", type=int, default=7447)
    p.set_defaults(func=cmd_dissect)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ltp-lab", description="LTP network lab: namespaces, impairments, tools.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for path in COMMAND_MODULES:
        importlib.import_module(path).register(sub)
    for reg in _extra_registrars:
        reg(sub)
    return ap


def main(argv=None) -> int:
    """Entry point of ``ltp-lab``; returns the exit status."""
    ap = build_parser()
    args = ap.parse_args(argv)
    from ltp_tools.netlab import LabUnsupported
    from ltp_tools.experiments._common import ExperimentError
    try:
        return int(args.func(args) or 0)
    except LabUnsupported as e:
        print(f"ltp-lab: {e}", file=sys.stderr)
        return 1
    except (ValueError, argparse.ArgumentTypeError, FileNotFoundError) as e:
        # the experiments check their arguments as they start (an unknown row, a loss of 1.5, a missing file):
        # a usage error, one line, no traceback (LTP_LAB_TRACEBACK=1 shows it)
        if os.environ.get("LTP_LAB_TRACEBACK"):
            raise
        print(f"ltp-lab {getattr(args, 'command', '')}: error: {e}", file=sys.stderr)
        return 2
    except ExperimentError as e:
        print(f"ltp-lab {getattr(args, 'command', '')}: the experiment failed: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
