"""`embark_jax.core.cpu_env`: the CPU kernels' environment switches."""

import pytest

from embark_jax.core import cpu_env

SWITCHES = ("EMBARK_CPU_TUNING", "EMBARK_HUGEPAGES", "EMBARK_MALLOC", "EMBARK_CPU_SPIN")


@pytest.fixture
def env(monkeypatch):
    for name in (*SWITCHES, "EMBARK_CPU_ISA", "EMBARK_CPU_THREADS"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    "value, mode", [(" ON ", "auto"), ("1", "auto"), ("Off", "off"), ("0", "off"), ("yes", None)]
)
def test_parse_huge_page_mode(value, mode):
    assert cpu_env.parse_huge_page_mode(value) == mode


def test_tuning_is_the_default_and_each_switch_wins(env):
    assert cpu_env.huge_page_mode_from_env() == "auto"  # huge pages: on unless turned off
    assert cpu_env.malloc_mode_from_env() == cpu_env.spin_mode_from_env() == "off"
    env.setenv("EMBARK_CPU_TUNING", "off")
    assert cpu_env.huge_page_mode_from_env() == "off"
    env.setenv("EMBARK_CPU_TUNING", "on")
    env.setenv("EMBARK_MALLOC", "0")
    assert cpu_env.huge_page_mode_from_env() == cpu_env.spin_mode_from_env() == "auto"
    assert cpu_env.malloc_mode_from_env() == "off"


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("EMBARK_CPU_ISA", "sse", "EMBARK_CPU_ISA='sse': expected auto, scalar, avx2"),
        ("EMBARK_CPU_THREADS", "0", "EMBARK_CPU_THREADS='0': expected a positive integer"),
        ("EMBARK_CPU_SPIN", "maybe", "EMBARK_CPU_SPIN='maybe': expected auto, on, 1, off or 0"),
    ],
)
def test_check_cpu_env_names_the_variable_and_value(env, name, value, message):
    cpu_env.check_cpu_env()
    env.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        cpu_env.check_cpu_env()
