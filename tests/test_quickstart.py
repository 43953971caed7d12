"""The README's "Quick start with your own features" runs as written in a fresh interpreter
(no fixtures, no JAX/XLA settings from the test) and learns."""

import re

from tests.test_readme import readme_python_blocks, run_clean


def test_quickstart_with_own_arrays_runs_and_learns(tmp_path):
    blocks = [b for b in readme_python_blocks() if "class Model(nnx.Module)" in b]
    assert len(blocks) == 1, "the README has one quick start example"
    r = run_clean(blocks[0], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", r.stdout).groups())
    assert last < 0.5 * first, r.stdout
