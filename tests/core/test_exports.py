"""`embark_jax.core.exports.lazy_exports`: a package's names imported on first use."""

import subprocess
import sys

import pytest

from embark_jax.core.exports import lazy_exports


def test_names_resolve_from_their_submodule_and_are_cached():
    import embark_jax.core as pkg

    names, getattr_, dir_ = lazy_exports(
        "embark_jax.core", {"name_mismatch": "names", "choice": "embark_jax.core.choice"}
    )
    from embark_jax.core import choice
    from embark_jax.core.names import name_mismatch

    assert names == ["choice", "name_mismatch"]
    assert getattr_("name_mismatch") is name_mismatch and pkg.__dict__["name_mismatch"] is (
        name_mismatch
    )
    assert getattr_("choice") is choice  # a name that is its module's last part: the module
    assert {"choice", "name_mismatch"} <= set(dir_())


def test_an_unknown_name_is_an_attribute_error():
    _, getattr_, _ = lazy_exports("embark_jax.core", {})
    with pytest.raises(AttributeError, match=r"module 'embark_jax\.core' has no attribute 'nope'"):
        getattr_("nope")


def test_importing_the_training_package_loads_no_orbax():
    code = "import sys, embark_jax.training; print('orbax.checkpoint' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
