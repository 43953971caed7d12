"""`embark_jax.core.options.RuntimeOptions`: validated, hashable run-time settings."""

import jax.numpy as jnp
import pytest

from embark_jax.core.options import CommDtype, DPGradients, OverflowPolicy, RuntimeOptions


def test_string_fields_parse_to_enums_and_equal_options_hash_alike():
    a = RuntimeOptions(comm_dtype="BFloat16", dp_gradients="sparse", overflow="error")
    assert (a.comm_dtype, a.dp_gradients, a.overflow) == (
        CommDtype.BFLOAT16,
        DPGradients.SPARSE,
        OverflowPolicy.ERROR,
    )
    assert a.strict and not RuntimeOptions().strict
    assert hash(a) == hash(
        RuntimeOptions(comm_dtype=CommDtype.BFLOAT16, dp_gradients="sparse", overflow="error")
    )


def test_to_wire_casts_only_when_asked():
    x = jnp.ones((2,), jnp.float32)
    assert RuntimeOptions().to_wire(x) is x
    assert RuntimeOptions(comm_dtype="bfloat16").to_wire(x).dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(capacity_factor=0), "capacity_factor must be a finite number > 0, got 0"),
        (dict(capacity_factor=float("inf")), "capacity_factor must be a finite number > 0"),
        (dict(capacity_factor=True), "capacity_factor must be a finite number > 0, got True"),
        (dict(hierarchical=1), "hierarchical must be a bool, got 1"),
        (dict(overflow="drop"), "unknown overflow policy 'drop'; expected one of: count, error"),
        (dict(comm_dtype="fp8"), "unknown comm dtype 'fp8'"),
    ],
)
def test_bad_values_are_one_line_errors(kw, message):
    with pytest.raises(ValueError) as e:
        RuntimeOptions(**kw)
    assert message in str(e.value) and "\n" not in str(e.value)
