"""``ltp-bench``'s unit parsers: sizes, rates and times, and the values they refuse."""

from __future__ import annotations

import argparse

import pytest

import numpy as np

from ltp_tools.bench import parse_rate, parse_size, parse_time
from ltp_tools.payload import pattern, verify


@pytest.mark.parametrize("text, want", [("200M", 200_000_000), ("1G", 10 ** 9), ("512Mi", 512 * 2 ** 20),
                                        ("1", 1), ("98MB", 98_000_000), ("1.5k", 1500),
                                        ("0.1G", 10 ** 8), ("1.5Gi", 3 * 2 ** 29)])
def test_sizes(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("text", ["0", "0M", "0.0001", "-5M", "lots", ""])
def test_empty_or_bad_sizes_are_refused_naming_an_example(text):
    with pytest.raises(argparse.ArgumentTypeError, match=r"e\.g\."):
        parse_size(text)


@pytest.mark.parametrize("text", ["1.5", "2.0005k", "0.0000000015G", "1..5M"])
def test_sizes_that_are_not_whole_bytes_are_refused_not_rounded(text):
    """``--size 1.5`` once ran a 1-byte transfer; a fraction of a byte is an error that names whole sizes."""
    with pytest.raises(argparse.ArgumentTypeError, match=r"whole number|e\.g\."):
        parse_size(text)


def test_rates_and_times():
    assert parse_rate("1gbit") == 1e9 and parse_rate("500mbit") == 5e8 and parse_rate("none") is None
    assert parse_time("10ms") == pytest.approx(0.01) and parse_time("0.5s") == 0.5 and parse_time("10") == 0.01
    for bad, fn in (("fast", parse_rate), ("soon", parse_time)):
        with pytest.raises(argparse.ArgumentTypeError):
            fn(bad)


@pytest.mark.parametrize("start, size", [(0, 1), (0, 17), (3, 5), (5, 11), (8, 8), (1455, 1460), (7, 1)])
def test_the_test_pattern_at_any_offset_is_a_slice_of_the_whole(start, size):
    whole = pattern(start + size + 9)
    assert np.array_equal(pattern(size, start), whole[start:start + size])


def test_a_tolerant_delivery_is_verified_outside_and_inside_its_bubbles():
    """``ltp-bench --mode tolerant`` once reported ``verified: null`` whenever a bubble existed."""
    msg = pattern(10_000).copy()
    holed = msg.copy()
    holed[1456:2912] = 0
    holed[9000:] = 0
    bubbles = [(1456, 2912), (9000, 10_000)]
    assert verify(holed, bubbles, step=700)
    assert verify(msg, [], step=700)
    assert not verify(holed, [], step=700)  # zeros where the report says data arrived
    bad = holed.copy()
    bad[5000] ^= 1
    assert not verify(bad, bubbles, step=700)  # one flipped byte outside the bubbles
    bad = holed.copy()
    bad[2000] = 1
    assert not verify(bad, bubbles, step=700)  # a bubble that is not zero-filled
    assert not verify(holed, [(9000, 10_001)])  # a bubble past the end
    assert not verify(holed, [(9000, 10_000), (1456, 2912)])  # out of order


def test_a_jitter_larger_than_the_delay_is_refused_before_any_lab_is_built(capsys):
    from ltp_tools.bench import main, run_bench

    with pytest.raises(SystemExit) as exc:
        main(["--delay", "1ms", "--jitter", "2ms"])
    assert exc.value.code == 2 and "must not exceed --delay" in capsys.readouterr().err
    with pytest.raises(ValueError, match="jitter must be in 0..delay"):
        run_bench(delay_s=0.001, jitter_s=0.002)
    with pytest.raises(ValueError, match="jitter must be in 0..delay"):
        run_bench(jitter_s=-0.001)
