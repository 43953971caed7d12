"""The README's code examples run as written in a fresh interpreter: a subprocess with a
clean environment (no conftest fixtures, no JAX or XLA settings from the test)."""

import os
import re
import subprocess
import sys

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def readme_python_blocks() -> list[str]:
    with open(README) as fh:
        return re.findall(r"```python\n(.*?)```", fh.read(), re.S)


def run_clean(code: str, cwd, timeout: int = 300) -> subprocess.CompletedProcess:
    """`code` in a new interpreter whose environment has no JAX_* / XLA_* variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    script = cwd / "example.py"
    script.write_text(code)
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_readme_example_runs_verbatim_in_a_fresh_interpreter(tmp_path):
    code = readme_python_blocks()[0]
    check = (
        "\nassert res.outputs['clicked'].shape == (64, 16), res.outputs['clicked'].shape"
        "\nassert res.outputs['user'].shape == (64, 16)"
        "\nassert all(int(v) == 0 for v in res.overflow.values()), res.overflow"
        "\nprint('README example OK')\n"
    )
    r = run_clean(code + check, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "README example OK" in r.stdout
