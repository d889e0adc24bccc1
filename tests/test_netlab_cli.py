"""ltp-lab CLI: check, up/list/exec/down, clean, and the subcommand registry."""
import os
import secrets
import signal
import subprocess
import sys

import pytest

from ltp_tools import cli
from ltp_tools.netlab import check_support, list_netns

_problem = check_support()
pytestmark = [pytest.mark.skipif(_problem is not None, reason=f"network lab unavailable: {_problem}"),
              pytest.mark.timeout(60)]


@pytest.fixture(autouse=True)
def state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LTP_LAB_STATE", str(tmp_path / "state"))
    return tmp_path / "state"


def test_check(capsys):
    assert cli.main(["check"]) == 0
    out = capsys.readouterr().out
    assert "usable" in out and "delay backend:" in out


def test_up_exec_down(capfd, state_dir):
    name = f"t{secrets.token_hex(3)}"
    prefix = f"ltplab-{name}-"
    try:
        assert cli.main(["up", name, "--hosts", "2", "--delay", "0.002"]) == 0
        out = capfd.readouterr().out
        assert "10.77.0.1" in out and "10.77.0.2" in out
        assert (state_dir / f"{name}.json").exists()
        assert len(list_netns(prefix)) == 3
        assert cli.main(["up", name]) == 1                  # already up
        assert cli.main(["list"]) == 0
        assert name in capfd.readouterr().out
        assert cli.main(["exec", name, "h1", "--", "ip", "-4", "-o", "addr", "show", "dev", "ltpeth0"]) == 0
        assert "10.77.0.2/24" in capfd.readouterr().out
        assert cli.main(["exec", name, "h1", "--", "sh", "-c", "exit 3"]) == 3
        assert cli.main(["exec", name, "h9", "--", "true"]) == 2
        # the delay set by `up` is live after the CLI returned (delayer runs detached)
        assert cli.main(["exec", name, "h1", "--", "python", "-m", "ltp_tools.netlab.measure", "ping",
                         "10.77.0.1", "--count", "3"]) == 0
        import json
        rtts = json.loads(capfd.readouterr().out.strip().splitlines()[-1])["rtts_s"]
        assert len(rtts) == 3 and min(rtts) > 0.002
    finally:
        assert cli.main(["down", name]) == 0
    assert list_netns(prefix) == []
    assert not (state_dir / f"{name}.json").exists()


def test_up_with_gro_records_it_and_turns_it_on(capfd, state_dir):
    import json

    name = f"t{secrets.token_hex(3)}"
    try:
        assert cli.main(["up", name, "--hosts", "2", "--gro", "--loss", "0.01"]) == 0
        assert json.loads((state_dir / f"{name}.json").read_text())["gro"] is True
        capfd.readouterr()
        assert cli.main(["exec", name, "h0", "--", "ethtool", "-k", "ltpeth0"]) == 0
        assert "generic-receive-offload: on" in capfd.readouterr().out
    finally:
        assert cli.main(["down", name]) == 0
    assert list_netns(f"ltplab-{name}-") == []


def test_clean_removes_leftovers(capsys):
    prefix = f"ltplabc-{secrets.token_hex(3)}-"
    for n in ("sw", "h0"):
        subprocess.run(["ip", "netns", "add", prefix + n], check=True)
    assert cli.main(["clean", "--prefix", prefix]) == 0
    assert "removed namespace" in capsys.readouterr().out
    assert list_netns(prefix) == []
    assert cli.main(["clean", "--prefix", prefix]) == 0
    assert "nothing left" in capsys.readouterr().out


_OWNER = """
import sys, time
from ltp_tools.netlab import Lab
with Lab(n_hosts=1, prefix=sys.argv[1]):
    print("up", flush=True)
    time.sleep(60)
"""


def _start_owner(prefix):
    p = subprocess.Popen([sys.executable, "-c", _OWNER, prefix], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ), start_new_session=True)
    assert p.stdout.readline().strip() == "up"
    return p


def test_clean_keeps_a_lab_that_a_live_process_runs_and_force_removes_it(capsys, state_dir):
    """`ltp-lab clean` once deleted the namespaces of every running benchmark on the machine."""
    prefix = f"ltplabo-{secrets.token_hex(3)}"
    leftover = f"{prefix}x-sw"  # a crashed run's namespace: no live owner, same clean prefix
    subprocess.run(["ip", "netns", "add", leftover], check=True)
    p = _start_owner(prefix)
    try:
        assert (state_dir / "owners" / prefix).exists()
        assert cli.main(["clean", "--prefix", "ltplabo-"]) == 0
        out = capsys.readouterr().out
        assert f"kept lab {prefix}: process {p.pid}" in out and f"removed namespace {leftover}" in out
        assert list_netns(prefix + "-") == [f"{prefix}-h0", f"{prefix}-sw"] and leftover not in list_netns(prefix)
        assert cli.main(["clean", "--prefix", prefix, "--force"]) == 0
        assert f"removed namespace {prefix}-sw" in capsys.readouterr().out
        assert list_netns(prefix + "-") == [] and not (state_dir / "owners" / prefix).exists()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
        cli.main(["clean", "--prefix", prefix, "--force"])


def test_an_owner_that_died_does_not_protect_its_lab(capsys, state_dir):
    prefix = f"ltplabo-{secrets.token_hex(3)}"
    p = _start_owner(prefix)
    os.killpg(p.pid, signal.SIGKILL)  # no chance to close its lab: a crash
    p.wait(timeout=10)
    try:
        assert len(list_netns(prefix + "-")) == 2
        assert cli.main(["clean", "--prefix", prefix]) == 0
        assert "kept lab" not in capsys.readouterr().out
        assert list_netns(prefix + "-") == [] and not (state_dir / "owners" / prefix).exists()
    finally:
        cli.main(["clean", "--prefix", prefix, "--force"])


def test_registry_adds_subcommands(capsys):
    def register(sub):
        p = sub.add_parser("hello-exp")
        p.add_argument("--n", type=int, default=1)
        p.set_defaults(func=lambda args: print("hello", args.n) or 0)

    cli.register_module(register)
    try:
        assert cli.main(["hello-exp", "--n", "3"]) == 0
        assert "hello 3" in capsys.readouterr().out
    finally:
        cli._extra_registrars.remove(register)
