"""``python -m ltp_tools.profile_transfer``: where an LTP transfer's CPU goes, per stage, from ``perf``.

Theory of operation
    Two processes, sender and receiver (in a two-host lab where namespaces work, on
    loopback otherwise), move one warm-up message and then ``--messages`` measured
    ones of ``--size`` bytes (reliable mode).  While the measured messages flow,
    ``perf record -g -p PID`` samples each process; every sample's symbol is sorted
    into one *stage*:

    ========================  ====================================================
    ``user copy``             libc ``memmove``/``memcpy`` (payload copies in user space)
    ``kernel copy``           ``_copy_from_iter``/``_copy_to_iter``/``copy_user*``
    ``kernel page faults``    page clearing and fault handling
    ``kernel net/syscall``    every other kernel frame (UDP/IP, veth, qdisc, syscalls)
    ``python``                the interpreter (``libpython``), the event loop, numpy
    ``ltp compiled``          ``ltp_ext`` modules (codec, datapath, socket batching)
    ``other``                 anything else
    ========================  ====================================================

    Each stage's share of the samples times the process's CPU-seconds (``getrusage``
    over the measured messages) gives CPU-seconds per delivered GB per stage; dividing
    by the packet count gives nanoseconds per packet.  Run it on an otherwise idle
    machine; compare only profiles taken side by side.  ``--compare`` adds a run with
    the gather send off (``Config.gather_send``) for a before/after table.

    Needs ``perf`` (``linux-perf``/``linux-tools``) and permission to attach
    (root, or ``kernel.perf_event_paranoid`` <= 1).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time

from ltp.regimes import Regime

STAGES = ("user copy", "kernel copy", "kernel page faults", "kernel net/syscall", "python", "ltp compiled", "other")
_USER_COPY = re.compile(r"(memmove|memcpy)")
_KERNEL_COPY = re.compile(r"(_copy_from_iter|_copy_to_iter|copy_user|copy_page_|rep_movs)")
_FAULTS = re.compile(r"(clear_page|page_fault|folio_zero|do_anonymous_page|handle_mm_fault)")


def classify(dso: str, sym: str) -> str:
    """The stage of one ``perf report`` line (``dso``, ``symbol``)."""
    if dso.startswith("[kernel"):
        if _KERNEL_COPY.search(sym):
            return "kernel copy"
        if _FAULTS.search(sym):
            return "kernel page faults"
        return "kernel net/syscall"
    if "libc" in dso and _USER_COPY.search(sym):
        return "user copy"
    if "libpython" in dso or "uvloop" in dso or "loop.cpython" in dso or "numpy" in dso \
            or "_multiarray" in dso or dso.startswith("python"):
        return "python"
    if any(m in dso for m in ("_datapath", "_wire", "_udpio")):
        return "ltp compiled"
    return "other"


def stage_shares(report_text: str) -> dict:
    """Parse ``perf report --no-children --sort dso,sym --stdio -g none`` into stage -> share (0..1)."""
    shares = dict.fromkeys(STAGES, 0.0)
    line_re = re.compile(r"^\s*([0-9.]+)%\s+(\S+)\s+\[[.k]\]\s+(.*)$")
    for line in report_text.splitlines():
        m = line_re.match(line)
        if m:
            shares[classify(m.group(2), m.group(3).strip())] += float(m.group(1)) / 100.0
    total = sum(shares.values())
    return {k: (v / total if total else 0.0) for k, v in shares.items()}


# ---------------------------------------------------------------------------- roles
def _role(argv) -> int:
    import asyncio  # noqa: F401  (ltp.run drives the loop)
    import resource

    import numpy as np

    import ltp

    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["_recv", "_send"])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--bind", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=7447)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--messages", type=int, default=3)
    ap.add_argument("--gather-send", type=int, default=1)
    a = ap.parse_args(argv)
    cfg = ltp.Config(gather_send=bool(a.gather_send))

    def cpu():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    async def main():
        if a.role == "_recv":
            ep = await ltp.open_endpoint((a.bind, a.port), config=cfg)
            buf = np.ones(a.size, np.uint8)
            print("READY", flush=True)
            await ep.recv(buf, tag=0, timeout=300)
            c0 = cpu()
            for i in range(1, a.messages + 1):
                rep = await ep.recv(buf, tag=i, timeout=300)
                if rep.regime != Regime.COMPLETE:
                    raise SystemExit(f"message {i} ended {rep.regime}")
            out = dict(cpu_s=cpu() - c0)
        else:
            ep = await ltp.open_endpoint((a.bind, 0), config=cfg)
            data = np.ones(a.size, np.uint8)
            await ep.send((a.host, a.port), data, reliable=True, tag=0, timeout=300)
            print("SENDING", flush=True)
            c0, t0 = cpu(), time.perf_counter()
            packets = 0
            for i in range(1, a.messages + 1):
                rep = await ep.send((a.host, a.port), data, reliable=True, tag=i, timeout=300)
                packets += rep.packets_sent
            out = dict(cpu_s=cpu() - c0, duration_s=time.perf_counter() - t0, packets=packets)
        await ep.close()
        print(json.dumps(out), flush=True)

    ltp.run(main())
    return 0


# ---------------------------------------------------------------------------- orchestration
def _last_json(text: str) -> dict:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no result in output:\n{text[-1500:]}")


def profile(*, size: int = 500_000_000, messages: int = 3, gather_send: bool = True, record_s: float = 1.0,
            use_lab: bool | None = None) -> dict:
    """Run one profiled transfer; return per-side CPU, stage shares and ns/packet per stage."""
    perf = shutil.which("perf")
    if perf is None:
        raise SystemExit("perf is not installed (Debian: apt-get install linux-perf)")
    from ltp_tools.netlab import Lab, check_support

    if use_lab is None:
        use_lab = check_support() is None
    lab = Lab(n_hosts=2).start() if use_lab else None
    tmp = tempfile.mkdtemp(prefix="ltp-profile-")
    procs = []
    try:
        py = sys.executable
        common = ["--size", str(size), "--messages", str(messages), "--gather-send", str(int(gather_send))]
        kw = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if lab is not None:
            snd, rcv = lab.hosts
            rp = lab.popen(rcv, [py, "-m", "ltp_tools.profile_transfer", "_recv", "--bind", "0.0.0.0", *common], **kw)
            host = rcv.addr
        else:
            rp = subprocess.Popen([py, "-m", "ltp_tools.profile_transfer", "_recv", *common], **kw)
            host = "127.0.0.1"
        procs.append(rp)
        if rp.stdout.readline().strip() != "READY":
            raise RuntimeError(f"receiver did not start: {rp.communicate()[0][-1500:]}")
        argv = [py, "-m", "ltp_tools.profile_transfer", "_send", "--host", host, "--bind", "0.0.0.0", *common]
        sp = lab.popen(lab.hosts[0], argv, **kw) if lab is not None else subprocess.Popen(argv, **kw)
        procs.append(sp)
        if sp.stdout.readline().strip() != "SENDING":
            raise RuntimeError(f"sender did not start: {sp.communicate()[0][-1500:]}")
        recs = [subprocess.Popen([perf, "record", "-g", "-q", "-o", f"{tmp}/{name}.data", "-p", str(p.pid), "--",
                                  "sleep", str(record_s)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                for name, p in (("sender", sp), ("receiver", rp))]
        for r in recs:
            r.wait(timeout=record_s + 60)
        s_out = _last_json(sp.communicate(timeout=600)[0])
        r_out = _last_json(rp.communicate(timeout=120)[0])
        res = dict(size=size, messages=messages, gather_send=gather_send,
                   path="lab" if lab is not None else "loopback", packets=s_out["packets"],
                   goodput_gbps=round(size * messages * 8 / s_out["duration_s"] / 1e9, 3), sides={})
        gb = size * messages / 1e9
        for name, out in (("sender", s_out), ("receiver", r_out)):
            rep = subprocess.run([perf, "report", "-i", f"{tmp}/{name}.data", "--no-children", "--sort", "dso,sym",
                                  "--stdio", "-g", "none"], capture_output=True, text=True, timeout=300)
            shares = stage_shares(rep.stdout)
            res["sides"][name] = dict(
                cpu_s=round(out["cpu_s"], 3), cpu_s_per_gb=round(out["cpu_s"] / gb, 3),
                stages={k: dict(share=round(v, 3), cpu_s_per_gb=round(v * out["cpu_s"] / gb, 3),
                                ns_per_packet=round(v * out["cpu_s"] / max(1, s_out["packets"]) * 1e9, 1))
                        for k, v in shares.items()})
        return res
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        if lab is not None:
            lab.close()
        shutil.rmtree(tmp, ignore_errors=True)


def table(results: list[dict]) -> str:
    """Markdown table: one row per (configuration, side, stage)."""
    rows = ["| config | side | stage | share | CPU s/GB | ns/packet |", "|---|---|---|---|---|---|"]
    for r in results:
        cfg = f"gather_send={int(r['gather_send'])}"
        for side, d in r["sides"].items():
            rows.append(f"| {cfg} | {side} | **total** | 1.0 | {d['cpu_s_per_gb']} | - |")
            for st, v in d["stages"].items():
                if v["share"] >= 0.005:
                    rows.append(f"| {cfg} | {side} | {st} | {v['share']} | {v['cpu_s_per_gb']} | {v['ns_per_packet']} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ltp_tools.profile_transfer", description=__doc__.split("\n\n")[0])
    from ltp_tools.bench import parse_size

    ap.add_argument("--size", type=parse_size, default=parse_size("500M"))
    ap.add_argument("--messages", type=int, default=3)
    ap.add_argument("--record", type=float, default=1.0, help="seconds of perf sampling per side")
    ap.add_argument("--compare", action="store_true", help="also profile with the gather send off")
    ap.add_argument("--loopback", action="store_true", help="loopback even where the lab works")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    configs = [True] + ([False] if a.compare else [])
    results = [profile(size=a.size, messages=a.messages, gather_send=g, record_s=a.record,
                       use_lab=False if a.loopback else None) for g in configs]
    print(table(results))
    for r in results:
        print(f"gather_send={int(r['gather_send'])}: {r['goodput_gbps']} Gbit/s on {r['path']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        sys.exit(_role(sys.argv[1:]))
    sys.exit(main())
