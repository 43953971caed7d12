"""The README's code example runs as written (on the 8 fake devices)."""

import os
import re


def test_readme_example_runs():
    path = os.path.join(os.path.dirname(__file__), "..", "README.md")
    with open(path) as fh:
        code = re.findall(r"```python\n(.*?)```", fh.read(), re.S)[0]
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    res = scope["res"]
    assert res.outputs["clicked"].shape == (64, 16) and res.outputs["user"].shape == (64, 16)
    assert all(int(v) == 0 for v in res.overflow.values())
