"""The package's layer contract (docs/design.md, "Package layout"), enforced.

Layers, lowest first; a module may import its own layer and the layers listed for it, never
a higher one. Every import is checked, including those inside functions (a lazy import of a
higher layer is still a dependency). The native extension modules belong to `ops`.
"""

import ast
import pathlib
import subprocess
import sys
import textwrap

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "embark_jax"

ALLOWED = {
    "core": set(),
    "planner": {"core"},
    "data": {"core"},
    "ops": {"core"},
    "sharding": {"core", "data", "ops"},
    "training": {"core", "data", "ops", "sharding"},
    "cli": {"core", "data", "ops", "sharding", "training", "planner"},
}
NATIVE = {"_ffi_cpu", "_ffi_cuda", "_build_info"}  # built by CMake, loaded by ops.native
# third-party frameworks the pure layers must not load, even lazily
PURE = {
    "core": {"jax", "jaxlib", "flax", "optax", "orbax"},
    "planner": {"jax", "jaxlib", "flax", "optax", "orbax"},
}
# the only lazy JAX imports the data model makes: a default initializer and the mesh
PURE_EXCEPTIONS = {("core/specs.py", "jax"), ("core/plan.py", "jax")}


def _layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "embark_jax" or len(parts) < 2:
        return None
    return "ops" if parts[1] in NATIVE else parts[1]


def _module_of(path: pathlib.Path, root: pathlib.Path) -> str:
    """`embark_jax.x.y` for `root/x/y.py` (`embark_jax.x` for a package's __init__)."""
    parts = ["embark_jax", *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute module of `from <level dots><name> import ...` inside `module`."""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, *([name] if name else [])])


def _literal_modules(node: ast.Call, package: str):
    """Modules a call names with string literals: `importlib.import_module("m")` and the
    values of `lazy_exports(__name__, {...})` (relative to the package unless absolute)."""
    func = node.func
    fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if fname == "import_module" and node.args and isinstance(node.args[0], ast.Constant):
        yield str(node.args[0].value)
    elif fname == "lazy_exports" and len(node.args) > 1 and isinstance(node.args[1], ast.Dict):
        for v in node.args[1].values:
            if isinstance(v, ast.Constant) and isinstance(v.value, str):
                yield v.value if v.value.startswith("embark_jax") else f"{package}.{v.value}"


def _imports(path: pathlib.Path, root: pathlib.Path = PKG):
    """(line, module) of every import in `path`: plain and `from` imports anywhere (inside
    functions too), relative ones resolved, and modules named by `importlib.import_module`
    or `lazy_exports` with a string literal."""
    tree = ast.parse(path.read_text(), str(path))
    module = _module_of(path, root)
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            base = (
                node.module
                if node.level == 0
                else _relative(module, is_package, node.level, node.module)
            )
            if not base:
                continue
            if base in ("embark_jax", package) or node.level:
                for a in node.names:  # `from embark_jax import sharding`, `from . import x`
                    yield node.lineno, f"{base}.{a.name}"
            else:
                yield node.lineno, base
        elif isinstance(node, ast.Call):
            for name in _literal_modules(node, package):
                yield node.lineno, name


def _violations(root: pathlib.Path) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if len(rel.parts) == 1:  # embark_jax/__init__.py, __main__.py: the lazy front door
            continue
        layer = rel.parts[0]
        assert layer in ALLOWED, f"{rel}: folder {layer!r} is in no layer; add it to the contract"
        for line, mod in _imports(path, root):
            target = _layer_of(mod)
            if target is not None and target != layer and target not in ALLOWED[layer]:
                bad.append(f"{rel}:{line}: layer {layer!r} imports {mod} (layer {target!r})")
            top = mod.split(".")[0]
            if top in PURE.get(layer, ()) and (rel.as_posix(), top) not in PURE_EXCEPTIONS:
                bad.append(f"{rel}:{line}: pure layer {layer!r} imports {mod}")
    return bad


def test_no_import_crosses_a_layer_upwards():
    assert _violations(PKG) == []


def test_the_contract_check_can_fail(tmp_path):
    """A planted upward import is reported (the check is not vacuous)."""
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "x.py").write_text(
        "def f():\n    from embark_jax.sharding import routing\n"
    )
    (tmp_path / "planner").mkdir()
    (tmp_path / "planner" / "y.py").write_text("import jax.numpy as jnp\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "z.py").write_text(
        "from ..training import loop\nfrom .. import sharding\nfrom . import batch\n"
        "import importlib\nm = importlib.import_module('embark_jax.cli.main')\n"
    )
    bad = _violations(tmp_path)
    assert len(bad) == 5, bad
    assert "core/x.py:2" in bad[0] and "planner/y.py:1" in bad[4]
    assert [b.split(":")[1] for b in bad[1:4]] == ["1", "2", "5"], bad  # data/z.py


@pytest.mark.smoke
def test_planning_loads_no_jax_and_no_kernels():
    """`import embark_jax.planner` and a whole planning run in a fresh interpreter never load
    JAX, Flax or the native kernels: the planner is arithmetic."""
    code = textwrap.dedent(
        """
        import sys
        import embark_jax
        from embark_jax import planner
        model = planner.load_preset("dcnv2-mini")
        hw = planner.get_hardware("dgx-h100", 1, 8)
        ev = planner.plan(model, 4096, hw)
        assert ev.plan.topology.num_devices == 8
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in
                        ("jax", "jaxlib", "flax", "optax", "orbax")
                        or m in ("embark_jax.ops.native", "embark_jax._ffi_cpu"))
        print("LOADED", loaded)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "LOADED []" in out.stdout, out.stdout


@pytest.mark.smoke
def test_cli_plan_loads_no_kernels(tmp_path):
    code = textwrap.dedent(
        f"""
        import sys
        from embark_jax.cli.main import main
        rc = main(["plan", "--model", "dcnv2-mini", "--nodes", "1", "--devices-per-node", "8",
                   "--batch-size", "4096", "--topology", "dgx-h100",
                   "--out", {str(tmp_path / "p.json")!r}])
        assert rc == 0, rc
        print("NATIVE", "embark_jax._ffi_cpu" in sys.modules, "embark_jax.ops.native" in sys.modules)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "NATIVE False False" in out.stdout, out.stdout


def test_importing_the_package_is_lazy():
    """`import embark_jax` loads no framework and none of our modules but the lazy-export
    helper; `embark_jax.training` loads its names on first use (no Orbax before then)."""
    code = "import sys, embark_jax; print(sorted(m for m in sys.modules if m.startswith(('jax', 'flax', 'embark_jax.'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['embark_jax.core', 'embark_jax.core.exports']", out.stdout
    code = "import sys, embark_jax.training as t; t.StepRunner; print('orbax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False"], out.stderr


@pytest.mark.parametrize(
    "package",
    [
        "embark_jax",
        "embark_jax.core",
        "embark_jax.data",
        "embark_jax.sharding",
        "embark_jax.training",
        "embark_jax.ops",
        "embark_jax.planner",
    ],
)
def test_every_package_exports_its_public_names(package):
    import importlib

    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None, f"{package}.{name}"


def test_public_api_resolves():
    import embark_jax

    for name in embark_jax.__all__:
        assert getattr(embark_jax, name) is not None, name
    assert not [n for n in embark_jax.__all__ if n.startswith("_") and n != "__version__"]


# the tests mirror the package: a folder per layer (and the kernels, the experiments), each
# module's tests in tests/<layer>/test_<module>.py; only whole-project checks stay at the top
TEST_FOLDERS = set(ALLOWED) | {"xla_ffi", "experiments"}
PROJECT_TESTS = {"test_layers.py", "test_readme.py", "test_quickstart.py"}


def test_the_tests_mirror_the_layers():
    tests = pathlib.Path(__file__).resolve().parent
    misplaced = [
        str(p.relative_to(tests))
        for p in tests.rglob("test_*.py")
        if (p.parent == tests and p.name not in PROJECT_TESTS)
        or (p.parent != tests and p.relative_to(tests).parts[0] not in TEST_FOLDERS)
    ]
    assert not misplaced, f"tests outside tests/<layer>/: {misplaced}"
    for folder in TEST_FOLDERS & {p.name for p in tests.iterdir() if p.is_dir()}:
        assert (tests / folder / "__init__.py").exists(), folder
