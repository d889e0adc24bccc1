"""``ltp-bench``'s unit parsers: sizes, rates and times, and the values they refuse."""

from __future__ import annotations

import argparse

import pytest

from ltp_tools.bench import parse_rate, parse_size, parse_time


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
