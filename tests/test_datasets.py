"""``ltp_ps.datasets``: scikit-learn's digits split, cached so that a job's processes do not each import it."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from ltp_ps import datasets


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LTP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _sklearn_split(seed):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]
    xtr, xte, ytr, yte = train_test_split(x, d.target, test_size=0.2, random_state=seed, stratify=d.target)
    return xtr, ytr, xte, yte


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("seed", [0, 5])
def test_the_split_is_scikit_learns_and_the_second_read_comes_from_the_cache(cache, monkeypatch, seed):
    first = datasets.digits_split(seed)
    assert _same(first, _sklearn_split(seed))
    assert os.listdir(cache) == [os.path.basename(datasets.cache_path(seed))]
    monkeypatch.setattr(datasets, "_compute", lambda s: pytest.fail("computed again despite the cache"))
    again = datasets.digits_split(seed)
    assert _same(again, first) and [a.dtype for a in again] == [np.float32, np.int64, np.float32, np.int64]


def test_seeds_do_not_share_a_cache_file(cache):
    a, b = datasets.digits_split(0), datasets.digits_split(1)
    assert not np.array_equal(a[1], b[1]) and len(os.listdir(cache)) == 2


@pytest.mark.parametrize("content", [b"", b"not a zip", None])
def test_a_torn_or_foreign_cache_file_is_recomputed_and_replaced(cache, content):
    path = datasets.cache_path(0)
    os.makedirs(cache)
    if content is None:  # a valid npz with wrong arrays (another layout)
        np.savez(path, x_train=np.zeros(3), y_train=np.zeros(3), x_test=np.zeros(3), y_test=np.zeros(3))
    else:
        open(path, "wb").write(content)
    assert _same(datasets.digits_split(0), _sklearn_split(0))
    assert datasets._read(path) is not None


def test_an_unwritable_cache_still_gives_the_split(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("LTP_CACHE_DIR", str(blocker / "sub"))  # cannot be created under a file
    assert _same(datasets.digits_split(0), _sklearn_split(0))


def test_the_cache_dir_follows_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.delenv("LTP_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert datasets.cache_dir() == str(tmp_path / "ltp")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert datasets.cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "ltp")


def test_a_process_with_a_warm_cache_does_not_import_scikit_learn(cache):
    code = ("import sys; from ltp_ps.workloads import DigitsWorkload; w = DigitsWorkload(); "
            "print(len(w.ytr), len(w.yte), 'sklearn' in sys.modules)")
    env = {**os.environ, "LTP_CACHE_DIR": str(cache)}
    cold = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    warm = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert cold.stdout.split() == ["1437", "360", "True"], cold.stderr
    assert warm.stdout.split() == ["1437", "360", "False"], warm.stderr
