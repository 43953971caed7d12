"""`Choice`: the base of the library's enums of named options (combiner, cluster, eviction,
run-time options, backend), with the one rule that parses them from user input."""

from __future__ import annotations

import enum
import re
from typing import Any

__all__ = ["Choice"]


class Choice(enum.Enum):
    """An enum whose values are lower-case names; `parse` takes a member or its name (any
    case, spaces around ignored) and refuses anything else with a one-line error that names
    the kind, the value and the choices."""

    @classmethod
    def parse(cls, value: Any):
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            choices = ", ".join(c.value for c in cls)
            message = f"unknown {cls.kind()} {value!r}; expected one of: {choices}"
            raise cls.error_type()(message) from None

    @classmethod
    def kind(cls) -> str:
        """What the enum names, in words: `CommDtype` -> "comm dtype"."""
        return re.sub(r"(?<=[a-z])(?=[A-Z])", " ", cls.__name__).lower()

    @classmethod
    def error_type(cls) -> type[Exception]:
        return ValueError
