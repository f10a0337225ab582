"""Hypothesis strategies for arbitrary MessagePack values, shared by the fuzz tests of the
control protocol (tests/wire/test_control_fuzz.py, tests/server/test_bad_input.py)."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st


def msgpack_scalars(*, text_size: int) -> st.SearchStrategy[object]:
    """Every MessagePack scalar: nil, booleans, 64-bit integers, floats (NaN too), text, bin."""
    return (
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**63), max_value=2**64 - 1)
        | st.floats(allow_nan=True)
        | st.text(max_size=text_size)
        | st.binary(max_size=40)
    )


def msgpack_values(
    scalars: st.SearchStrategy[object],
    fields: Sequence[str],
    *,
    key_size: int,
    max_leaves: int,
) -> st.SearchStrategy[object]:
    """Nested arrays and maps of `scalars`; map keys are text (often one of `fields`, so a
    decoder sees its own field names) or small integers."""
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=5)
            | st.dictionaries(
                st.text(max_size=key_size) | st.sampled_from(fields), inner, max_size=5
            )
            | st.dictionaries(st.integers(min_value=-5, max_value=5), inner, max_size=3)
        ),
        max_leaves=max_leaves,
    )
