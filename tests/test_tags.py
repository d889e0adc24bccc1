"""Structured tags: packing round-trips, ordering by iteration, range checks."""

import pytest
from hypothesis import given, strategies as st

from ltp_ps.schedules import tags
from ltp_ps.schedules.tags import Tag

fields = st.tuples(st.integers(0, tags.MAX_ITERATION), st.integers(0, tags.MAX_PHASE),
                   st.integers(0, tags.MAX_STEP), st.integers(0, tags.MAX_CHUNK), st.integers(0, tags.MAX_KIND))


@given(fields)
def test_round_trip(f):
    t = Tag(*f)
    packed = t.pack()
    assert 0 <= packed < 2 ** 63  # fits a signed 64-bit field too
    assert Tag.unpack(packed) == t
    assert tags.unpack(tags.pack(*f)) == t


@given(fields, fields)
def test_iteration_is_most_significant(a, b):
    ta, tb = Tag(*a), Tag(*b)
    if ta.iteration < tb.iteration:
        assert ta.pack() < tb.pack()
        assert ta.pack() < tags.round_floor(tb.iteration) <= tb.pack()
    if ta != tb:
        assert ta.pack() != tb.pack()


@pytest.mark.parametrize("kw", [dict(iteration=-1), dict(iteration=tags.MAX_ITERATION + 1),
                                dict(iteration=0, chunk=tags.MAX_CHUNK + 1), dict(iteration=0, kind=16),
                                dict(iteration=0, step=True)])
def test_out_of_range_fields_raise(kw):
    with pytest.raises(ValueError, match="outside"):
        Tag(**kw)


def test_unpack_rejects_foreign_ints():
    with pytest.raises(ValueError):
        Tag.unpack(1 << 63)
    with pytest.raises(ValueError):
        Tag.unpack(-1)


def test_describe_names_the_phase():
    assert Tag(5, tags.PHASE_ALL_GATHER, 2, 7, 1).describe()["phase"] == "all_gather"
