"""The ``ltp`` backend is registered whichever of ``ltp_ps`` and torch a program imports first, and a process
that never trains (the launcher, a config error) does not import torch at all (``ltp_ps.torch_plugin``)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

from ltp_ps import torch_plugin

# a one-rank process group over the registered backend, and which modules that took
_ALL_REDUCE = """
import torch, torch.distributed as dist
dist.init_process_group("ltp", store=dist.HashStore(), rank=0, world_size=1)
t = torch.arange(4, dtype=torch.float32)
dist.all_reduce(t)
assert t.tolist() == [0.0, 1.0, 2.0, 3.0], t
dist.destroy_process_group()
print("OK")
"""


def _python(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=full_env)


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_the_entry_point_is_installed_and_torch_autoload_is_on():
    # the rest of this file tests the installed package; an install without the entry point would pass them
    # all through the fallback (an eager torch import) and hide the regression
    assert torch_plugin.autoload_installed(), (
        "ltp_ps.torch_plugin is not in torch's 'torch.backends' entry points: reinstall (pip install -e .)")


def test_import_ltp_ps_does_not_import_torch_and_torch_afterwards_registers_the_backend():
    out = _ok(_python("""
import sys
import ltp_ps
assert "torch" not in sys.modules, "import ltp_ps imported torch"
import torch.distributed as dist
assert "ltp" in dist.Backend.backend_list, dist.Backend.backend_list
assert "ltp_ps.backend" not in sys.modules, "registering imported the backend module"
""" + _ALL_REDUCE))
    assert out.strip().endswith("OK")


def test_torch_first_then_ltp_ps_registers_the_backend():
    assert _ok(_python("import torch\nimport ltp_ps\n" + _ALL_REDUCE)).strip().endswith("OK")


def test_a_bare_torch_import_registers_the_backend_through_the_entry_point():
    # no `import ltp_ps` at all: torch's autoload registered it; the backend module still loads only on use
    assert _ok(_python("""
import sys, torch.distributed as dist
assert "ltp" in dist.Backend.backend_list
assert "ltp_ps.backend" not in sys.modules
""" + _ALL_REDUCE)).strip().endswith("OK")


def test_with_torch_autoload_off_import_ltp_ps_imports_torch_and_registers():
    out = _ok(_python("""
import sys
import ltp_ps
assert "torch" in sys.modules, "autoload off: ltp_ps must register by itself, so it imports torch"
import torch.distributed as dist
assert "ltp" in dist.Backend.backend_list
""" + _ALL_REDUCE, TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert out.strip().endswith("OK")


def test_without_the_entry_point_autoload_is_not_assumed(monkeypatch):
    import importlib.metadata

    real = importlib.metadata.distribution(torch_plugin.DISTRIBUTION)

    class NoEntryPoints:
        entry_points = importlib.metadata.EntryPoints(
            [ep for ep in real.entry_points if ep.group != "torch.backends"])

    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: NoEntryPoints())
    assert not torch_plugin.autoload_installed()

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)  # a source tree on PYTHONPATH

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    assert not torch_plugin.autoload_installed()

    def broken(name):
        raise OSError("unreadable metadata")

    monkeypatch.setattr(importlib.metadata, "distribution", broken)
    assert not torch_plugin.autoload_installed()
    monkeypatch.undo()
    monkeypatch.setenv(torch_plugin.AUTOLOAD_ENV, "0")
    assert not torch_plugin.autoload_installed()


def test_a_registration_failure_warns_instead_of_breaking_import_torch(monkeypatch):
    import torch.distributed as dist

    def refuse(*args, **kwargs):
        raise ValueError("refused")

    monkeypatch.setattr(torch_plugin, "registered", lambda: False)
    monkeypatch.setattr(dist.Backend, "register_backend", refuse)
    with pytest.warns(RuntimeWarning, match=r"could not register .*'ltp'.*ValueError: refused.*backend.register\(\)"):
        torch_plugin.register()
    with pytest.raises(ValueError, match="refused"):  # the explicit form says why
        torch_plugin.install()


def test_register_is_idempotent():
    import torch.distributed as dist

    from ltp_ps import backend

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch_plugin.register()
        backend.register()
        torch_plugin.register()
    assert torch_plugin.registered()
    assert dist.Backend.backend_list.count("ltp") == 1


def test_the_launcher_and_a_config_error_do_not_import_torch():
    _ok(_python("import sys, ltp_ps.cli\nassert 'torch' not in sys.modules, sorted(m for m in sys.modules "
                "if m.startswith('ltp_ps'))"))
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "ltp_ps.cli", "launch", "--workers", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--workers must be >= 1" in proc.stderr, proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time")}
    assert "ltp_ps" in imported and "torch" not in imported


def test_lazy_exports_resolve_and_unknown_names_raise():
    import ltp_ps

    for name in ltp_ps.__all__:
        assert getattr(ltp_ps, name) is not None, name
    assert set(ltp_ps.__all__) <= set(dir(ltp_ps))
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        ltp_ps.Nope  # noqa: B018
    from ltp_ps import Worker
    from ltp_ps.worker import Worker as W

    assert Worker is W
