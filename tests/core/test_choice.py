"""`embark_jax.core.choice.Choice`: parsing a named option from user input."""

import pytest

from embark_jax.core.choice import Choice


class CommMode(Choice):
    FAST = "fast"
    SAFE = "safe"


def test_parse_takes_a_member_or_its_name_in_any_case():
    assert CommMode.parse(CommMode.SAFE) is CommMode.SAFE
    assert CommMode.parse("  FaSt ") is CommMode.FAST


def test_kind_splits_the_class_name_into_words():
    assert CommMode.kind() == "comm mode"


def test_an_unknown_value_is_one_line_naming_kind_value_and_choices():
    with pytest.raises(ValueError) as e:
        CommMode.parse("slow")
    assert str(e.value) == "unknown comm mode 'slow'; expected one of: fast, safe"
