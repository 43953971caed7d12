"""embark_jax.sharding.hlo_scan: which instructions of a compiled HLO module read or write a
whole table or slot (the step check's and the loop benchmark's copy detector)."""

import jax
import jax.numpy as jnp
import pytest

from embark_jax import ops
from embark_jax.ops import optimizers as O
from embark_jax.sharding import hlo_scan

pytestmark = pytest.mark.smoke

TEXT = """HloModule m, is_scheduled=true

%fused_computation (param_0: f32[1,6,4]) -> f32[6,4] {
  %param_0 = f32[1,6,4]{2,1,0} parameter(0)
  %bitcast.1 = f32[6,4]{1,0} bitcast(%param_0)
  ROOT %copy.2 = f32[6,4]{1,0} copy(%bitcast.1)
}

%region_0 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[6,4]{1,0} add(%a, %b)
}

ENTRY %main (p0: f32[1,6,4], p1: s32[3]) -> (f32[1,6,4], f32[6,4]) {
  %p0 = f32[1,6,4]{2,1,0} parameter(0)
  %p1 = s32[3]{0} parameter(1)
  %bitcast_copy_fusion = f32[6,4]{1,0} fusion(%p0), kind=kLoop, calls=%fused_computation
  %ffi = (f32[6,4]{1,0}, u8[1]{0}) custom-call(%bitcast_copy_fusion, %p1), custom_call_target="embark_sparse_grad_update", output_to_operand_aliasing={{0}: (0, {})}
  %gte = f32[6,4]{1,0} get-tuple-element(%ffi), index=0
  %look = (f32[6,4]{1,0}, u8[1]{0}) custom-call(%gte, %p1), custom_call_target="embark_lookup_pool"
  %r = f32[] reduce(%gte, %c), dimensions={0,1}, to_apply=%region_0
  %copy.9 = f32[1,6,4]{2,1,0} copy(%gte)
  %other = f32[6,5]{1,0} add(%gte, %gte)
  ROOT %t = (f32[1,6,4]{2,1,0}, f32[6,4]{1,0}) tuple(%copy.9, %gte)
}
"""


def test_scan_lists_whole_buffer_ops_outside_fusion_bodies():
    found = hlo_scan.scan(TEXT, {"tables/g": ("float32", (1, 6, 4))})
    by_name = {f["name"]: f for f in found}
    # the fusion (its root a copy), the final copy, and what reads the whole table: the
    # scalar reduce and the add of another shape; not the parameters, bitcasts, the row
    # kernels (the update, the lookup), get-tuple-element, tuple, nor anything inside the
    # fusion body or the reducer region
    assert set(by_name) == {"bitcast_copy_fusion", "copy.9", "r", "other"}
    assert by_name["bitcast_copy_fusion"]["root"] == "copy"
    assert by_name["bitcast_copy_fusion"]["copy"] and by_name["copy.9"]["copy"]
    assert by_name["r"]["reads"] and by_name["other"]["reads"] and not by_name["r"]["copy"]
    assert not by_name["copy.9"]["reads"]
    assert by_name["copy.9"]["buffers"] == ["tables/g"] == by_name["r"]["buffers"]
    s = hlo_scan.summary(found, limit=1)
    assert s["count"] == 4 and s["copies"] == 2 and s["copied_buffers"] == ["tables/g"]
    assert len(s["ops"]) == 1
    # dtype matters: the same shape in another type is not the table
    assert hlo_scan.scan(TEXT, {"x": ("bfloat16", (6, 4))}) == []


def test_parse_reads_tuple_shapes_and_roots():
    comps = hlo_scan.parse(TEXT)
    assert set(comps) == {"fused_computation", "region_0", "main"}
    ffi = next(i for i in comps["main"] if i.name == "ffi")
    assert ffi.opcode == "custom-call" and ffi.arrays == (("f32", (6, 4)), ("u8", (1,)))
    assert [i.name for i in comps["fused_computation"] if i.is_root] == ["copy.2"]


def _rowwise(t, acc, g, ids, seg):
    opt = O.RowWiseAdagrad(learning_rate=0.1)
    state = O.RowWiseAdagradState(acc)
    t, state, _ = ops.lookup_pool_backward_update(t, state, g, ids, seg, optimizer=opt)
    return t, state.accumulator


def test_a_donated_fused_update_touches_no_whole_table_and_an_undonated_one_copies_it():
    args = (
        jnp.ones((1000, 16)),
        jnp.zeros((1000,)),
        jnp.ones((8, 16)),
        jnp.arange(32, dtype=jnp.int32),
        jnp.repeat(jnp.arange(8, dtype=jnp.int32), 4),
    )
    bufs = {"table": ("float32", (1000, 16)), "accumulator": ("float32", (1000,))}
    donated = jax.jit(_rowwise, donate_argnums=(0, 1)).lower(*args).compile().as_text()
    assert "embark_sparse_grad_update" in donated
    assert hlo_scan.scan(donated, bufs) == []
    kept = jax.jit(_rowwise).lower(*args).compile().as_text()
    copied = hlo_scan.summary(hlo_scan.scan(kept, bufs))
    assert copied["copies"] >= 2 and copied["copied_buffers"] == ["accumulator", "table"]
