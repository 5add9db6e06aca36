"""Hostile review (session 51) of the code merged this session: distpack, ptwrite, report."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainguard.distpack import pack, unpack


def _wire(values):
    """What a rank other than 0 gets: rank 0's pack, through the store's JSON, unpacked."""
    return unpack(json.loads(json.dumps(pack(values))))


@pytest.mark.parametrize("values", [
    [0.0, -0.0],  # 0.0 == -0.0: were merged into one table entry, rank 1 read 0.0
    [{"loss": 0.0}, {"loss": -0.0}],
    [{1: "a"}, {"1": "b"}],  # two fields whose JSON keys were the same "1": rank 0's value was lost
    [{"a": 1, "b": 2}, {"b": 2, "a": 1}],  # rank 1's key order became rank 0's
    [{"b": None}, {"a": None, "b": None}],
])
def test_distpack_round_trips_like_json(values):
    got = _wire(values)
    assert json.dumps(got) == json.dumps(json.loads(json.dumps(values)))


_scalar = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=4)
           | st.sampled_from([0.0, -0.0, 1, 1.0, True, "1"]))
_value = st.recursive(_scalar, lambda c: st.lists(c, max_size=3) | st.tuples(c) | st.dictionaries(
    st.sampled_from(["a", "b", "n", "col", "fields", "order"]), c, max_size=3), max_leaves=8)


@settings(max_examples=300, suppress_health_check=list(HealthCheck), deadline=None)
@given(st.lists(_value | st.dictionaries(st.sampled_from(["a", "b", "c", "order"]) | st.integers(0, 2), _value,
                                         max_size=3), max_size=5))
def test_distpack_property_json_text_equal(values):
    assert json.dumps(_wire(values)) == json.dumps(json.loads(json.dumps(values)))
