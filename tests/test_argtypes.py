"""``ltp_ps.argtypes.bounded``: the one bounded-number argparse type every ltp-ps option uses."""

import argparse

import pytest

from ltp_ps.argtypes import bounded


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
