"""``ltp_ps.argtypes``: the bounded-number type every ltp-ps option uses, and ``--model``'s name check."""

import argparse

import pytest

import subprocess

from ltp_ps.argtypes import bounded, model_name
from ltp_ps.model_names import MAX_SYNTHETIC_PARAMS

from ps_helpers import child_env, ps_cmd


def test_accepts_the_bound_and_above():
    assert bounded(int, 1, "rounds")("1") == 1
    assert bounded(float, 0.0, "lr")("0") == 0.0 and bounded(float, 0.0, "lr")("2.5") == 2.5


@pytest.mark.parametrize("kind,lo,strict,text,says", [
    (int, 1, False, "0", "0 is out of range: rounds must be >= 1 (pass --x 2)"),
    (int, 1, False, "2.5", "'2.5' is not a whole number; rounds must be >= 1 (pass --x 2)"),
    (float, 0.0, True, "0", "0 is out of range: rounds must be > 0.0 (pass --x 2)"),
    (float, 0.0, False, "nan", "nan is out of range"), (float, 0.0, False, "inf", "inf is out of range"),
    (float, 0.0, False, "-inf", "-inf is out of range"), (float, 0.0, False, "soon", "'soon' is not a number"),
])
def test_refuses_naming_the_meaning_and_the_fix(kind, lo, strict, text, says):
    with pytest.raises(argparse.ArgumentTypeError) as e:
        bounded(kind, lo, "rounds", "pass --x 2", strict=strict)(text)
    assert says in str(e.value)


def test_an_upper_bound_is_exclusive():
    m = bounded(float, 0.0, "SGD momentum", "1 or more diverges", below=1.0)
    assert m("0") == 0.0 and m("0.99") == 0.99
    for text in ("1", "1.0", "3"):
        with pytest.raises(argparse.ArgumentTypeError) as e:
            m(text)
        assert "SGD momentum must be >= 0.0 and < 1.0 (1 or more diverges)" in str(e.value)


@pytest.mark.parametrize("name", ["digits", "resnet50", "vgg16", "synthetic:1", "synthetic:1e6",
                                  f"synthetic:{MAX_SYNTHETIC_PARAMS}"])
def test_model_names_accepted(name):
    assert model_name(name) == name


@pytest.mark.parametrize("name,says", [
    ("synthetic:0", "whole number of parameters"), ("synthetic:-5", "whole number of parameters"),
    ("synthetic:2.5", "whole number of parameters"), ("synthetic:abc", "whole number of parameters"),
    ("synthetic:nan", "whole number of parameters"), ("synthetic:inf", "whole number of parameters"),
    (f"synthetic:{MAX_SYNTHETIC_PARAMS + 1}", "whole number of parameters"), ("resnet", "unknown model 'resnet'"),
    ("", "unknown model ''"),
])
def test_model_names_refused(name, says):
    with pytest.raises(argparse.ArgumentTypeError) as e:
        model_name(name)
    assert says in str(e.value)


@pytest.mark.parametrize("bad", [["--model", "synthetic:0"], ["--momentum", "1.5"]])
def test_launch_refuses_before_it_spawns_anything(bad):
    """Found by trying it: ``--model synthetic:0`` started a store, a PS and the workers, and the PS died with
    "cannot split 0 parameters"; ``--momentum 1.5`` trained 69 rounds to an infinite loss before failing."""
    p = subprocess.run(ps_cmd("launch", "--lab", "off", "--workers", 2, *bad), env=child_env(), capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "[launch] started" not in p.stdout and "error: argument" in p.stderr, p.stdout + p.stderr
