"""What the machine must provide for the lab, and removal of leftovers.

Theory of operation
    The lab needs root (CAP_NET_ADMIN/CAP_SYS_ADMIN) to create network namespaces, the
    ``ip`` binary (``ip netns exec`` runs programs inside a namespace), pyroute2, veth and
    bridge links, ``nft`` with netdev-family ingress hooks (loss and counters), the ``tbf``
    qdisc (rate), ``ethtool`` (offloads off) and, for delay, either ``tc netem`` or the
    NFQUEUE path (``iptables-legacy`` plus gcc and libnetfilter_queue to build the C delayer).

    :func:`check_support` answers "can a lab be created at all?" (None or a reason string);
    :func:`probe` builds a scratch namespace once and reports every capability, including
    whether netem exists (tried on a scratch veth: there is no dummy link type on some kernels).
    :func:`clean` deletes every namespace whose name starts with a prefix, after killing the
    processes inside it, so a crashed run never leaves anything behind. A lab that a live process
    still runs is not a leftover: :func:`claim` records the owner (pid and start time, so a reused
    pid does not count) under :func:`state_dir`, and :func:`clean` keeps that lab's namespaces
    unless told ``force=True``.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import socket
import threading
import secrets
import shutil
import signal
import subprocess
import time

DEFAULT_PREFIX = "ltplab-"
#: kernel timer ticks per second assumed where the kernel's config cannot be read (the usual distribution
#: default; the lower it is, the larger the tbf bucket: 4 ms of tokens at 250)
DEFAULT_KERNEL_HZ = 250
NETNS_DIR = "/run/netns"
_CLONE_NEWNET = 0x40000000
_NETLINK_ROUTE = 0
_setns_lock = threading.Lock()


class LabUnsupported(RuntimeError):
    """The machine cannot run the lab (or a requested feature); the message says how to fix it."""


def _ns_exec(netns: str, argv: list[str], **kw) -> subprocess.CompletedProcess:
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    kw.setdefault("timeout", 30)
    return subprocess.run(["ip", "netns", "exec", netns, *argv], **kw)


def netns_add(name: str) -> None:
    """Create a named network namespace (``ip netns add``: iproute2 manages /run/netns mounts)."""
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise OSError(f"`ip netns add {name}` failed: {r.stderr.strip()}")


def netns_del(name: str) -> None:
    """Delete a named network namespace (no error if it is already gone)."""
    subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def in_netns(name: str):
    """Switch the calling thread into namespace ``name`` for the duration of the block."""
    libc = ctypes.CDLL(None, use_errno=True)
    with _setns_lock:
        back = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY)
        try:
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns({name}): {os.strerror(err)}")
            yield
        finally:
            if libc.setns(back, _CLONE_NEWNET) != 0:  # pragma: no cover - would leave us in the lab
                raise OSError(ctypes.get_errno(), "cannot return to the original network namespace")
            os.close(back)
            os.close(fd)


def iproute(name: str):
    """A pyroute2 ``IPRoute`` whose netlink socket lives in namespace ``name``.

    We open the socket ourselves (setns in this thread, socket(), setns back) instead of
    ``IPRoute(netns=name)``: pyroute2's helper process resolves names through its own view
    of /run/netns, which on some hosts does not show namespaces made by ``ip netns add``
    and then silently creates a new, empty namespace.
    """
    from pyroute2 import IPRoute

    with in_netns(name):
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_ROUTE)
    return IPRoute(fileno=s.detach())


@functools.lru_cache(maxsize=None)
def kernel_hz(paths: tuple = ()) -> int:
    """The running kernel's ``CONFIG_HZ``, from ``/boot/config-<release>`` or ``/proc/config.gz`` (or
    ``paths``), else :data:`DEFAULT_KERNEL_HZ`."""
    import gzip

    release = os.uname().release
    for path in paths or (f"/boot/config-{release}", "/proc/config.gz"):
        try:
            opener = gzip.open if path.endswith(".gz") else open
            with opener(path, "rt") as f:
                for line in f:
                    if line.startswith("CONFIG_HZ="):
                        hz = int(line.split("=", 1)[1])
                        if hz > 0:
                            return hz
        except (OSError, ValueError, EOFError):
            continue
    return DEFAULT_KERNEL_HZ


def check_support() -> str | None:
    """Return None when namespaces, veths, a bridge and nft work here, else a reason string.

    This is the gate for tests: a machine that fails it cannot host any lab. Missing
    optional pieces (delay backend, ethtool) are reported by :func:`probe` instead.
    """
    if os.geteuid() != 0:
        return "not root: the network lab creates namespaces; run as root (or with CAP_NET_ADMIN+CAP_SYS_ADMIN)"
    for tool, pkg in (("ip", "iproute2"), ("nft", "nftables"), ("ethtool", "ethtool"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            return f"`{tool}` not found: apt-get install {pkg}"
    try:
        import pyroute2  # noqa: F401
    except ImportError:
        return "pyroute2 is not installed: pip install 'pyroute2>=0.7' (extra `lab`)"
    p = _probe()
    return p.get("error")


@functools.lru_cache(maxsize=1)
def _probe() -> dict:
    from pyroute2.netlink.exceptions import NetlinkError

    name = f"{DEFAULT_PREFIX}probe{secrets.token_hex(2)}"
    res: dict = {}
    try:
        netns_add(name)
    except Exception as e:  # noqa: BLE001 - any failure means "no namespaces here"
        return {"error": f"cannot create a network namespace ({e}); `ip netns add` must work (root, /run/netns writable)"}
    try:
        with iproute(name) as ipr:
            try:
                ipr.link("add", ifname="ltpprobe0", kind="veth", peer="ltpprobe1")
                ipr.link("add", ifname="ltpprobebr", kind="bridge")
            except NetlinkError as e:
                return {"error": f"cannot create veth/bridge links ({e}); the kernel needs CONFIG_VETH and CONFIG_BRIDGE"}
            idx = ipr.link_lookup(ifname="ltpprobe0")[0]
            ipr.link("set", index=idx, state="up")
            try:
                ipr.tc("add", "tbf", index=idx, handle="1:", rate="100mbit", burst=15000, limit=100000)
                ipr.tc("del", index=idx, handle="1:", root=True)
                res["tbf"] = True
            except NetlinkError as e:
                return {"error": f"the tbf qdisc is missing ({e}); the kernel needs CONFIG_NET_SCH_TBF"}
            try:
                ipr.tc("add", "netem", index=idx, handle="1:", delay=1000)
                ipr.tc("del", index=idx, handle="1:", root=True)
                res["netem"] = True
            except NetlinkError:
                res["netem"] = False
        r = _ns_exec(name, ["nft", "-f", "-"], input=(
            'table netdev ltpprobe { counter c {}\n chain i { type filter hook ingress device "ltpprobe0" priority 0;\n'
            ' ip length > 200 numgen random mod 100 < 1 counter name "c" drop\n }\n}\n'))
        if r.returncode != 0:
            return {"error": f"nftables netdev ingress/numgen rules fail: {r.stderr.strip()} (kernel needs nf_tables netdev + numgen)"}
        r = _ns_exec(name, ["ethtool", "-K", "ltpprobe0", "tso", "off", "gso", "off", "gro", "off"])
        if r.returncode != 0:
            return {"error": f"ethtool cannot switch offloads off: {r.stderr.strip()}"}
        if shutil.which("iptables-legacy"):
            r = _ns_exec(name, ["iptables-legacy", "-t", "raw", "-A", "PREROUTING", "-j", "NFQUEUE", "--queue-num", "0"])
            res["nfqueue"] = r.returncode == 0
            res["nfqueue_error"] = r.stderr.strip()
        else:
            res["nfqueue"] = False
            res["nfqueue_error"] = "iptables-legacy not found: apt-get install iptables"
        res["gcc"] = shutil.which("gcc") is not None
        res["libnetfilter_queue"] = os.path.exists("/usr/include/libnetfilter_queue/libnetfilter_queue.h")
    finally:
        kill_netns_pids(name)
        netns_del(name)
    return res


def probe() -> dict:
    """Capabilities of this machine: keys ``netem``, ``tbf``, ``nfqueue``, ``gcc``, ``libnetfilter_queue``
    (booleans) and ``error`` (present when no lab can be built)."""
    return dict(_probe())


def delay_backend() -> str:
    """``"netem"`` where ``tc netem`` works, else ``"nfqueue"`` (user-space C delayer), else ``"none"``.

    ``LTP_LAB_DELAY_BACKEND=nfqueue`` (or ``netem``) forces a backend, e.g. to compare the
    delayer with netem on a kernel that has both; forcing one that is missing raises.
    """
    p = _probe()
    forced = os.environ.get("LTP_LAB_DELAY_BACKEND")
    if forced:
        ok = {"netem": p.get("netem"),
              "nfqueue": p.get("nfqueue") and p.get("gcc") and p.get("libnetfilter_queue")}.get(forced)
        if ok is None:
            raise LabUnsupported(f"LTP_LAB_DELAY_BACKEND={forced!r}: use 'netem' or 'nfqueue'")
        if not ok:
            raise LabUnsupported(f"LTP_LAB_DELAY_BACKEND={forced!r} but that backend is not available here"
                                 + ("" if forced == "netem" else f": {delay_unavailable_reason()}"))
        return forced
    if p.get("netem"):
        return "netem"
    if p.get("nfqueue") and p.get("gcc") and p.get("libnetfilter_queue"):
        return "nfqueue"
    return "none"


def delay_unavailable_reason() -> str:
    p = _probe()
    missing = []
    if not p.get("nfqueue"):
        missing.append(f"iptables-legacy NFQUEUE ({p.get('nfqueue_error', '')})")
    if not p.get("gcc"):
        missing.append("gcc (apt-get install gcc)")
    if not p.get("libnetfilter_queue"):
        missing.append("libnetfilter_queue headers (apt-get install libnetfilter-queue-dev)")
    return "no delay backend: the kernel has no netem and the NFQUEUE delayer needs " + ", ".join(missing)


def list_netns(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Names of the network namespaces that start with ``prefix``."""
    try:
        names = os.listdir(NETNS_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(prefix))


def kill_netns_pids(name: str, grace_s: float = 1.0) -> int:
    """SIGTERM, then SIGKILL after ``grace_s``, every process inside namespace ``name``; returns the count."""
    r = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=10)
    pids = [int(p) for p in r.stdout.split() if p.strip().isdigit() and int(p) != os.getpid()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        if alive:
            time.sleep(0.02)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie child of ours still "exists": reap it if it is ours
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().split(b") ", 1)[1][:1] != b"Z"


def state_dir() -> str:
    """Where the lab keeps what outlives a call: ``ltp-lab up``'s lab descriptions and the owners of running labs
    (``$LTP_LAB_STATE``, default ``/run/ltp-lab``)."""
    return os.environ.get("LTP_LAB_STATE", "/run/ltp-lab")


def _owner_path(lab_prefix: str) -> str:
    return os.path.join(state_dir(), "owners", lab_prefix)


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b") ", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def claim(lab_prefix: str) -> None:
    """Record this process as the owner of the lab whose namespaces are ``<lab_prefix>-*``. Best effort: where
    the state directory cannot be written the lab still runs, only without this protection."""
    path = _owner_path(lab_prefix)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(f"{os.getpid()} {_start_time(os.getpid())}\n")
    except OSError:
        pass


def release(lab_prefix: str) -> None:
    """Forget the owner of ``lab_prefix`` (the lab is gone). Idempotent."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_owner_path(lab_prefix))


def owner(lab_prefix: str) -> int | None:
    """The pid of the live process that runs the lab ``lab_prefix``, or None (no owner recorded, or it died)."""
    try:
        with open(_owner_path(lab_prefix)) as f:
            pid_text, started = f.read().split()
        pid = int(pid_text)
    except (OSError, ValueError):
        return None
    return pid if _start_time(pid) == started else None


def lab_of(netns: str) -> str:
    """The lab prefix of one of its namespaces: ``ltplab-ab12cd-h3`` -> ``ltplab-ab12cd``."""
    return netns.rsplit("-", 1)[0]


def in_use(prefix: str = DEFAULT_PREFIX) -> dict[str, int]:
    """Labs with namespaces starting with ``prefix`` that a live process other than this one runs: {lab: pid}."""
    out = {}
    for name in list_netns(prefix):
        lab = lab_of(name)
        pid = owner(lab)
        if pid is not None and pid != os.getpid():
            out[lab] = pid
    return out


def clean(prefix: str = DEFAULT_PREFIX, *, force: bool = False) -> list[str]:
    """Kill processes in, then delete, every namespace whose name starts with ``prefix``.

    Every lab interface lives inside a lab namespace, so deleting the namespaces removes all
    links, qdiscs and nft/iptables rules too. The namespaces of a lab that another live process
    runs (:func:`in_use`) are kept unless ``force``. Returns the namespaces removed.
    """
    if not prefix:
        raise ValueError("refusing to clean with an empty prefix (it would match every namespace)")
    keep = set() if force else set(in_use(prefix))
    removed = []
    for name in list_netns(prefix):
        if lab_of(name) in keep:
            continue
        kill_netns_pids(name)
        netns_del(name)
        removed.append(name)
    for lab in {lab_of(n) for n in removed}:
        if not list_netns(lab + "-"):
            release(lab)
    return removed
