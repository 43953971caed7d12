"""The kernel ABI has one source of truth, `xla_ffi/include/embark_abi.h`: its Python mirror
(`embark_jax.ops.abi`), the optimizers and the native module must agree with it exactly."""

import dataclasses
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import embark_jax
from embark_jax.core.specs import Combiner
from embark_jax.ops import abi
from embark_jax.ops import optimizers as O
from embark_jax.ops import update as U

pytestmark = pytest.mark.smoke

HEADER = pathlib.Path(__file__).resolve().parents[2] / "xla_ffi" / "include" / "embark_abi.h"


def parse_x_macro(text: str, name: str) -> list[tuple[str, ...]]:
    """The entries of `#define <name>(X) X(a, b) ...` (backslash-continued), as string tuples."""
    m = re.search(rf"^#define {name}\(X\)((?:[^\n]*\\\n)*[^\n]*)", text, re.MULTILINE)
    assert m, f"{name} not found in {HEADER}"
    entries = [tuple(f.strip() for f in e.split(",")) for e in re.findall(r"X\(([^)]*)\)", m[1])]
    assert entries, f"{name} has no entries"
    return entries


@pytest.fixture(scope="module")
def header() -> str:
    return HEADER.read_text()


def _as_int_table(entries):
    return [(e[0], *map(int, e[1:])) for e in entries]


def test_parser_reads_a_planted_list():
    text = "#define EMBARK_ABI_DEMO(X) \\\n  X(A, 0)    \\\n  X(B_C, 1, 2)\nint x;\n"
    assert parse_x_macro(text, "EMBARK_ABI_DEMO") == [("A", "0"), ("B_C", "1", "2")]


def test_combiners_match_header(header):
    want = _as_int_table(parse_x_macro(header, "EMBARK_ABI_COMBINERS"))
    assert [(c.name, c.value) for c in abi.CombinerId] == want
    # _ffi maps the data model's combiner to the kernel's id by name.
    assert [c.name for c in Combiner] == [c.name for c in abi.CombinerId]


def test_optimizers_match_header(header):
    want = _as_int_table(parse_x_macro(header, "EMBARK_ABI_OPTIMIZERS"))
    assert [(o.name, o.value) for o in abi.OptimizerId] == [(n, i) for n, i, _, _ in want]
    assert [(o.name, *abi.SLOT_FOOTPRINT[o]) for o in abi.OptimizerId] == [
        (n, a, b) for n, _, a, b in want
    ]


def test_hparams_match_header(header):
    want = _as_int_table(parse_x_macro(header, "EMBARK_ABI_HPARAMS"))
    assert [(h.name, h.value) for h in abi.Hparam] == want
    assert abi.HPARAM_COUNT == len(want)


def test_targets_match_header_and_registration(header):
    entries = parse_x_macro(header, "EMBARK_ABI_TARGETS")
    assert [(t.name, t.value) for t in abi.Target] == [
        (name.upper(), f"embark_{name}") for name, _stem in entries
    ]
    assert abi.TARGETS == tuple(f"embark_{name}" for name, _ in entries)
    # The native module's registrations are generated from the same list.
    assert embark_jax.registered_targets()["cpu"] == tuple(sorted(abi.TARGETS))


ALL_OPTIMIZERS = [
    O.SGD(learning_rate=0.1),
    O.Adagrad(learning_rate=0.1, eps=1e-3),
    O.RowWiseAdagrad(learning_rate=0.1, eps=1e-3),
    O.Adam(learning_rate=0.1, b1=0.8, b2=0.95, eps=1e-3),
]


def test_every_kernel_optimizer_has_a_python_optimizer():
    assert sorted(o.kernel_id for o in ALL_OPTIMIZERS) == list(abi.OptimizerId)


@pytest.mark.parametrize("opt", ALL_OPTIMIZERS, ids=lambda o: type(o).__name__)
def test_slot_footprint_matches_slot_shapes(opt):
    vocab, dim = 7, 5
    shapes = list(opt.slot_shapes(vocab, dim).values())
    per_element = sum(1 for s in shapes if s == (vocab, dim))
    per_row = sum(1 for s in shapes if s == (vocab,))
    assert per_element + per_row == len(shapes), shapes  # no other kind of slot
    assert opt.slot_footprint == (per_element, per_row)
    a, b = opt.slot_footprint
    assert opt.slot_bytes(vocab, dim) == 4 * vocab * (dim * a + b)


def test_slot_footprint_values():
    assert [o.slot_footprint for o in ALL_OPTIMIZERS] == [(0, 0), (1, 0), (0, 1), (2, 0)]


@pytest.mark.parametrize("opt", ALL_OPTIMIZERS, ids=lambda o: type(o).__name__)
def test_kernel_slots_follow_the_footprint(opt):
    """The two slot operands the kernels get hold the per-element slots first, then the
    per-row ones, as the ABI's slot layout says (unused ones are [1] dummies)."""
    table = jnp.zeros((7, 5), jnp.float32)
    a, b = opt.slot_footprint
    kinds = [(7, 5)] * a + [(7,)] * b
    kinds += [(1,)] * (2 - len(kinds))
    got = [s.shape for s in U.kernel_slots(opt, opt.init(table))]
    assert got == kinds


def test_hparams_follow_the_layout():
    state = ALL_OPTIMIZERS[3].init(jnp.zeros((3, 2)))
    for opt in ALL_OPTIMIZERS:
        hp = np.asarray(U.kernel_hparams(opt, opt.init(jnp.zeros((3, 2)))))
        assert hp.shape == (abi.HPARAM_COUNT,) and hp.dtype == np.float32
        if isinstance(opt, O.Adam):
            continue
        assert hp[abi.Hparam.LR] == np.float32(opt.learning_rate)
        assert hp[abi.Hparam.EPS] == np.float32(getattr(opt, "eps", 0.0))
        assert hp[abi.Hparam.B1] == hp[abi.Hparam.B2] == 0.0
    adam = ALL_OPTIMIZERS[3]
    hp = np.asarray(U.kernel_hparams(adam, state))
    c1, c2 = 1 - adam.b1, 1 - adam.b2  # first step: bias corrections folded in
    np.testing.assert_allclose(hp[abi.Hparam.LR], adam.learning_rate * np.sqrt(c2) / c1, rtol=1e-6)
    np.testing.assert_allclose(hp[abi.Hparam.EPS], adam.eps * np.sqrt(c2), rtol=1e-6)
    assert (hp[abi.Hparam.B1], hp[abi.Hparam.B2]) == (np.float32(0.8), np.float32(0.95))


def test_kernel_hparams_read_a_schedule_at_the_step():
    """A learning-rate schedule is evaluated at the step given (traced or not); the seed
    asks for stochastic rounding, split into two exact halves."""
    opt = O.SGD(learning_rate=lambda step: 0.5 / (1.0 + step))
    state = opt.init(jnp.zeros((3, 2)))
    for step in (0, 3):
        hp = np.asarray(jax.jit(lambda s: U.kernel_hparams(opt, state, s))(step))
        assert hp[abi.Hparam.LR] == np.float32(0.5 / (1 + step))
        assert hp[abi.Hparam.ROUNDING] == 0.0
    hp = np.asarray(U.kernel_hparams(opt, state, 0, seed=np.uint32(0x12345678)))
    assert (hp[abi.Hparam.ROUNDING], hp[abi.Hparam.SEED_LO], hp[abi.Hparam.SEED_HI]) == (
        1.0,
        0x5678,
        0x1234,
    )
    with pytest.raises(ValueError, match="schedule; pass the step"):
        U.kernel_hparams(opt, state)


def test_optimizers_stay_frozen_dataclasses():
    # slot_footprint is a property, not a field: it must not change the constructor.
    assert "slot_footprint" not in {f.name for f in dataclasses.fields(O.Adam)}
