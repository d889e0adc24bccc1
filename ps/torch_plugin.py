"""Registers the ``torch.distributed`` backend ``ltp`` without importing the backend (or torch) before it is used.

Two callers, one effect (``dist.init_process_group("ltp")`` works afterwards):

* ``import ltp_ps`` calls :func:`register` when torch is already imported.
* ``import torch`` calls it through the entry point this package installs in torch's extension group
  ``torch.backends`` (PyTorch's autoload of out-of-tree extensions, RFC pytorch/pytorch#122468), so importing
  ``ltp_ps`` first and torch later needs nothing more either. ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns torch's
  autoload off; ``import ltp_ps`` then imports torch itself and registers at once (see ``ltp_ps/__init__.py``).

What is registered is a creator that imports :mod:`ltp_ps.backend` on the first process group, so every other
``import torch`` in the environment pays only for this module. Nothing here may raise: torch turns an entry
point's exception into a failed ``import torch`` for every program in the environment, so a failure is a warning
naming the fix.
"""

from __future__ import annotations

import os
import sys
import warnings

#: the name users pass to ``init_process_group``; :mod:`ltp_ps.backend` reads it from here
BACKEND_NAME = "ltp"
#: torch's switch for its extension autoload (the entry-point route above)
AUTOLOAD_ENV = "TORCH_DEVICE_BACKEND_AUTOLOAD"
#: the distribution (pyproject's ``name``) whose metadata carries the entry point
DISTRIBUTION = "ltp"


def _create(opts, pg_options=None):
    from . import backend

    return backend._create(opts, pg_options)


def registered() -> bool:
    """True once ``ltp`` is a ``torch.distributed`` backend in this process (False without torch imported)."""
    dist = sys.modules.get("torch.distributed")
    backend_cls = getattr(dist, "Backend", None)
    if backend_cls is None:
        return False
    return BACKEND_NAME in backend_cls.backend_list and backend_cls._plugins.get(BACKEND_NAME.upper()) is not None


def install() -> None:
    """Register ``ltp`` with ``torch.distributed`` (idempotent); errors propagate (:func:`register` is the quiet
    form)."""
    import torch.distributed as dist

    if not dist.is_available():  # torch builds without distributed support have no backends to register
        return
    if not registered():
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])


def register() -> None:
    """:func:`install`, but never raises (see the module docstring): a failure is a ``RuntimeWarning``."""
    try:
        install()
    except Exception as exc:  # noqa: BLE001 - never fail the caller's import
        warnings.warn(f"ltp_ps could not register the torch.distributed backend {BACKEND_NAME!r}: "
                      f"{type(exc).__name__}: {exc}; call ltp_ps.backend.register() to see the error",
                      RuntimeWarning, stacklevel=2)


def autoload_installed() -> bool:
    """True when ``import torch`` will call :func:`register`: this package's entry point is installed and torch's
    autoload is on.

    Reads this distribution's metadata only (0.7 ms here), not every installed one's as ``entry_points()`` does
    (16 ms, paid again by torch's own scan); the first distribution of that name on ``sys.path`` is the one
    torch's deduplicated scan reads too."""
    if os.environ.get(AUTOLOAD_ENV, "1") != "1":
        return False
    try:
        from importlib.metadata import distribution

        eps = distribution(DISTRIBUTION).entry_points.select(group="torch.backends")
        return any(ep.value.startswith(f"{__name__}:") for ep in eps)
    except Exception:  # noqa: BLE001 - not installed, or broken metadata: take the safe path (import torch at once)
        return False
