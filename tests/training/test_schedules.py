"""`embark_jax.training.schedules.WarmupDecay`: the MLPerf DLRM learning-rate schedule."""

import numpy as np
import pytest


def test_warmup_decay_schedule_and_its_flag():
    from embark_jax.training.schedules import WarmupDecay

    s = WarmupDecay.parse("warmup=10, decay_start=20, decay_steps=10")(2.0)
    got = [float(s(i)) for i in (0, 5, 10, 19, 20, 25, 30, 99)]
    np.testing.assert_allclose(got, [0.0, 1.0, 2.0, 2.0, 2.0, 0.5, 0.0, 0.0], atol=1e-6)
    for text, pattern in [
        ("warmup=x", "warmup must be an int, got 'x'"),
        ("warmup=-1", "warmup must be an int >= 0, got -1"),
        ("speed=3", "'speed=3' is not key=value"),
        ("warmup=5,decay_start=2,decay_steps=3", "decay_start 2 comes before"),
        ("warmup=1,warmup=2", "warmup given twice"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            WarmupDecay.parse(text)
