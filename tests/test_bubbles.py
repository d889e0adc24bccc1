"""ltp.bubbles: the critical-segment mask a sender builds for every message, and bubble byte ranges."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ltp.bubbles import bubble_byte_ranges, critical_mask, segment_geometry
from ltp.errors import LocalProtocolError


def _reference(ranges, total: int, seg: int):
    """The mask marked range by range, and its maximal runs read off the mask."""
    count = (total + seg - 1) // seg
    mask = np.zeros(count, np.uint8)
    for a, b in ranges:
        mask[a // seg:(b - 1) // seg + 1] = 1
    runs, i = [], 0
    while i < count:
        if mask[i]:
            j = i
            while j < count and mask[j]:
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    return mask, runs


@st.composite
def _message(draw):
    seg = draw(st.integers(1, 64))
    total = draw(st.integers(1, 40 * seg))
    pairs = draw(st.lists(st.tuples(st.integers(0, total - 1), st.integers(1, total)), max_size=12))
    ranges = [(a, b) if a < b else (b - 1, a + 1) for a, b in pairs]
    return ranges, total, seg


@settings(max_examples=400, deadline=None)
@given(_message())
def test_the_mask_and_its_merged_runs_match_marking_each_range(case):
    ranges, total, seg = case
    mask, runs = critical_mask(ranges, total, seg)
    ref_mask, ref_runs = _reference(ranges, total, seg)
    assert mask.dtype == np.uint8
    assert np.array_equal(mask, ref_mask)
    assert runs == ref_runs  # sorted, disjoint, and adjacent spans joined into one run


def test_ranges_in_any_order_and_touching_spans_give_one_run():
    # segments 0-1, 4, 2-3 (touching both) and 9: given out of order
    mask, runs = critical_mask([(4000, 4100), (0, 1500), (2000, 3999), (9000, 9001)], 10_000, 1000)
    assert runs == [(0, 5), (9, 10)]
    assert mask.tolist() == [1, 1, 1, 1, 1, 0, 0, 0, 0, 1]


def test_nothing_critical_and_a_generator_of_ranges():
    mask, runs = critical_mask([], 100, 10)
    assert runs == [] and not mask.any() and mask.shape == (10,)
    mask, runs = critical_mask(((a, a + 1) for a in (95, 5)), 100, 10)
    assert runs == [(0, 1), (9, 10)]


@pytest.mark.parametrize("bad, words", [
    ([(0, 101)], "outside"), ([(5, 5)], "outside"), ([(-1, 3)], "outside"),
    ([(0.5, 10)], "whole bytes"), ([(1, 2, 3)], "byte pairs"), ([("a", 3)], "byte pairs"), ([None], "byte pairs"),
])
def test_a_bad_range_raises_a_clear_error(bad, words):
    with pytest.raises(LocalProtocolError, match=words):
        critical_mask(bad, 100, 10)


def test_segment_geometry_and_bubble_ranges():
    assert segment_geometry(1400, 4) == (1400, 0)
    assert segment_geometry(1402, 4) == (1400, 2)
    with pytest.raises(LocalProtocolError, match="positive"):
        segment_geometry(1400, 0)
    with pytest.raises(LocalProtocolError, match="does not fit"):
        segment_geometry(3, 4)
    assert bubble_byte_ranges([(0, 1), (3, 5)], 100, 450) == [(0, 100), (300, 450)]
