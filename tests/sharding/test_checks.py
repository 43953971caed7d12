"""Host-side checks of lookup and update reports (`sharding.checks`): each error fires on a
concrete non-zero count or refused update, names the tables, and stays silent under `jit`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embark_jax.sharding import checks
from embark_jax.sharding.checks import check_applied, check_invalid, check_overflow


def test_overflow_names_only_the_tables_that_dropped_ids():
    check_overflow({"a": 0, "b": np.int32(0)})
    with pytest.raises(checks.CapacityOverflowError, match=r"\{'b': 3\}; raise the tables'"):
        check_overflow({"a": jnp.int32(0), "b": jnp.int32(3)})


def test_invalid_ids_error_is_a_value_error_naming_the_table():
    check_invalid({})
    with pytest.raises(checks.InvalidIdError, match=r"count per table\): \{'t': 1\}") as e:
        check_invalid({"t": np.int64(1), "u": 0})
    assert isinstance(e.value, ValueError)


def test_a_refused_update_raises_and_an_applied_one_does_not():
    check_applied(jnp.bool_(True), "apply_gradients")
    with pytest.raises(
        checks.NonFiniteUpdateError, match=r"^apply_gradients: the update would write"
    ):
        check_applied(np.bool_(False), "apply_gradients")


def test_under_jit_the_checks_defer_to_the_caller():
    @jax.jit
    def f(count, applied):
        check_overflow({"t": count})
        check_invalid({"t": count})
        check_applied(applied, "step")
        return count

    assert int(f(jnp.int32(5), jnp.bool_(False))) == 5
