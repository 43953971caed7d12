"""Lazy public names for a package's `__init__` (PEP 562), one list per package.

`lazy_exports(__name__, {"StepRunner": "runner", ...})` returns the package's `__all__`,
`__getattr__` and `__dir__`: a name is imported from its submodule on first use and cached,
so importing a package stays cheap (the planner never loads JAX, `embark_jax.training` does
not load Orbax until a checkpoint name is asked for). A value of `""` names a submodule
itself (`embark_jax.ops.optimizers` as `embark_jax.optimizers`: give its dotted path).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[list[str], Callable[[str], object], Callable[[], list[str]]]:
    """`(__all__, __getattr__, __dir__)` for `package`: each name in `exports` comes from the
    submodule `exports[name]` (relative to `package`, or absolute if it contains the package
    name); a name mapped to a module path that ends with the name itself is that module."""
    namespace = importlib.import_module(package).__dict__

    def resolve(name: str) -> object:
        where = exports[name]
        module = where if where.startswith("embark_jax") else f"{package}.{where}"
        if module.rsplit(".", 1)[-1] == name:  # the submodule itself
            return importlib.import_module(module)
        return getattr(importlib.import_module(module), name)

    def __getattr__(name: str) -> object:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = resolve(name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return sorted(exports), __getattr__, __dir__
