"""Test setup: 8 fake CPU devices (before any JAX op), strict numerics.

With EMBARK_TEST_GPU=1 (experiments/gpu_check.sh) the tests run on the GPU instead; tests
that need 8 devices skip when there are fewer. Tests marked `gpu` run only then.
"""

import os

ON_GPU = os.environ.get("EMBARK_TEST_GPU") == "1"
if not ON_GPU:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

if not ON_GPU:
    jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a GPU (run experiments/gpu_check.sh there)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
