"""README's two commands: exactly two set-up-and-go lines that do what the text promises."""

from __future__ import annotations

import os
import re
import shlex
import subprocess

import pytest

from ltp_ps import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tools", "install-lab-deps")


def _command(marker: str) -> str:
    text = open(os.path.join(REPO, "README.md")).read()
    m = re.search(rf"<!-- {marker} -->\n```bash\n(.*?)\n```", text, re.S)
    assert m, f"README.md has no ```bash block under <!-- {marker} -->"
    assert "\n" not in m.group(1).strip(), f"the {marker} must be one line"
    return m.group(1).strip()


def _steps(line: str) -> list[list[str]]:
    return [shlex.split(part) for part in line.split("&&")]


def test_readme_has_exactly_two_commands_at_the_top():
    text = open(os.path.join(REPO, "README.md")).read()
    head = text.split("\n## ", 1)[0]
    assert head.count("```bash") == 2
    assert head.index("<!-- main-command -->") < head.index("<!-- test-command -->")


def test_main_command_installs_the_lab_then_trains_with_loss_in_the_lab():
    steps = _steps(_command("main-command"))
    assert steps[0] == ["bash", "tools/install-lab-deps"]  # the lab's system packages, when root and missing
    assert steps[1][:3] == ["python", "-m", "pip"] and "install" in steps[1]
    assert any(a.startswith("-e") or a == "-e" for a in steps[1]) and any("lab" in a and "ps" in a for a in steps[1])
    assert steps[-1][0] == "ltp-ps"
    args = cli.build_parser().parse_args(steps[-1][1:])
    assert args.cmd == "launch" and args.loss > 0 and args.lab == "auto"
    # Without a lab these impairments are refused with the fix named, never silently dropped.
    with pytest.raises(cli.ConfigError, match="install-lab-deps"):
        cli._check_impairments(args, False, "not root")


def test_test_command_runs_pytest_and_ci_runs_it_with_the_same_lab_script():
    steps = _steps(_command("test-command"))
    assert steps[-1][:3] == ["python", "-m", "pytest"]
    ci = open(os.path.join(REPO, ".ci", "run")).read()
    assert "<!-- test-command -->" in ci and "tools/install-lab-deps" in ci


def test_lab_script_covers_everything_the_support_check_needs():
    out = subprocess.run(["bash", SCRIPT, "--dry-run"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    pkgs = set(re.search(r"lab packages: (.*)", out.stdout).group(1).split())
    # what ltp_tools.netlab.support asks for, by Debian package name
    support = open(os.path.join(REPO, "tools", "netlab", "support.py")).read()
    named = set(re.findall(r"apt-get install ([a-z0-9-]+)", support))
    assert named and named <= pkgs, named - pkgs
    assert {"nftables", "iproute2", "ethtool", "iptables", "libnetfilter-queue-dev", "gcc"} <= pkgs
    assert "missing here:" in out.stdout


def _fake_machine(tmp_path, uid: int):
    """A PATH with bash but none of the lab's tools, a fake ``id -u`` and an ``apt-get`` that logs its calls."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    os.symlink(subprocess.run(["bash", "-c", "command -v bash"], capture_output=True, text=True).stdout.strip(),
               bindir / "bash")
    for name, body in (("id", f"echo {uid}"), ("apt-get", f'echo "$@" >> {tmp_path}/apt.log')):
        (bindir / name).write_text(f"#!{bindir}/bash\n{body}\n")
        (bindir / name).chmod(0o755)
    return bindir


def test_lab_script_as_non_root_installs_nothing_and_says_why(tmp_path):
    bindir = _fake_machine(tmp_path, 1000)
    r = subprocess.run([str(bindir / "bash"), SCRIPT], capture_output=True, text=True, timeout=30,
                       env={"PATH": str(bindir)})
    assert r.returncode == 0, r.stderr
    assert "not root" in r.stderr and "nftables" in r.stderr
    assert not (tmp_path / "apt.log").exists()


def test_lab_script_as_root_on_a_fresh_machine_installs_what_is_missing(tmp_path):
    bindir = _fake_machine(tmp_path, 0)
    r = subprocess.run([str(bindir / "bash"), SCRIPT], capture_output=True, text=True, timeout=30,
                       env={"PATH": str(bindir)})
    assert r.returncode == 0, r.stderr
    calls = (tmp_path / "apt.log").read_text().splitlines()
    assert calls[0].split()[0] == "update"
    installed = set(calls[1].split()) - {"install", "-y", "-qq", "--no-install-recommends"}
    assert {"nftables", "iproute2", "ethtool", "iptables", "gcc"} <= installed
