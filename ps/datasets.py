"""scikit-learn's digits, split once per machine and cached.

Every PS and worker of a ``digits`` job needs the same stratified 80/20 split. Computing it imports
scikit-learn (and SciPy), about 2 s of CPU per process: in a five-process job on two cores that is most of the
start-up after torch itself. So the first process writes the split to a cache file and the others read it
with NumPy alone.

The cache file is named after everything the split depends on (scikit-learn's version, the seed, this
module's layout version); it is written to a temporary file and renamed into place, so concurrent writers
never leave a torn file; a file that does not read back as the expected arrays is recomputed and replaced.
Where no cache directory can be written, each process computes the split itself.

Cache directory: ``$LTP_CACHE_DIR``, else ``$XDG_CACHE_HOME/ltp``, else ``~/.cache/ltp``.
"""

from __future__ import annotations

import os
from importlib import metadata

import numpy as np

from .atomic_file import write_atomically

__all__ = ["digits_split", "cache_dir", "cache_path"]

LAYOUT = 1  # bump when the cached arrays change meaning
N_SAMPLES = 1797  # scikit-learn's digits
TEST_FRACTION = 0.2
_KEYS = ("x_train", "y_train", "x_test", "y_test")


def cache_dir() -> str:
    """Where cached splits live (see the module docstring)."""
    explicit = os.environ.get("LTP_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ltp")


def cache_path(seed: int) -> str | None:
    """The cache file of ``seed``'s split, or None if scikit-learn is not installed (nothing to key it by)."""
    try:
        version = metadata.version("scikit-learn")
    except metadata.PackageNotFoundError:
        return None
    return os.path.join(cache_dir(), f"digits-split-v{LAYOUT}-sklearn{version}-seed{int(seed)}.npz")


def _compute(seed: int) -> tuple:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]
    xtr, xte, ytr, yte = train_test_split(x, d.target, test_size=TEST_FRACTION, random_state=seed,
                                          stratify=d.target)
    return xtr, ytr.astype(np.int64), xte, yte.astype(np.int64)


def _valid(arrays: tuple) -> bool:
    xtr, ytr, xte, yte = arrays
    return (xtr.dtype == np.float32 and xte.dtype == np.float32 and ytr.dtype == np.int64 and yte.dtype == np.int64
            and xtr.ndim == 4 and xtr.shape[1:] == (1, 8, 8) and xte.shape[1:] == (1, 8, 8)
            and len(xtr) == len(ytr) and len(xte) == len(yte) and len(xtr) + len(xte) == N_SAMPLES
            and bool(np.isfinite(xtr).all() and np.isfinite(xte).all())
            and ytr.min() >= 0 and ytr.max() <= 9 and yte.min() >= 0 and yte.max() <= 9)


def _read(path: str) -> tuple | None:
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = tuple(np.array(f[k]) for k in _KEYS)
    except Exception:  # absent, torn or foreign (OSError, ValueError, KeyError, zipfile.BadZipFile): recompute
        return None
    return arrays if _valid(arrays) else None


def _write(path: str, arrays: tuple) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_atomically(path, lambda f: np.savez(f, **dict(zip(_KEYS, arrays))))
    except OSError:
        pass  # a read-only or full cache: the next process computes the split again


def digits_split(seed: int = 0) -> tuple:
    """``(x_train, y_train, x_test, y_test)`` NumPy arrays: images scaled to [0, 1] as float32 ``(n, 1, 8, 8)``,
    labels int64; scikit-learn's stratified 80/20 ``train_test_split`` with ``random_state=seed``."""
    path = cache_path(seed)
    if path is not None:
        arrays = _read(path)
        if arrays is not None:
            return arrays
    arrays = _compute(seed)
    if path is not None:
        _write(path, arrays)
    return arrays
