"""Hardware topologies (`planner.hardware`): presets, reshaping, lookup by name."""

import pytest

from embark_jax.planner import PRESETS, get_hardware
from embark_jax.planner.hardware import GB


def test_with_shape_keeps_the_device_and_changes_the_grid():
    hw = PRESETS["dgx-h100"].with_shape(2, 4)
    assert (hw.num_nodes, hw.devices_per_node, hw.num_devices) == (2, 4, 8)
    assert hw.memory_bytes == 80 * GB and hw.intra_bw == PRESETS["dgx-h100"].intra_bw
    t = hw.topology
    assert (t.num_nodes, t.devices_per_node) == (2, 4)


def test_get_hardware_presets_and_unknown_name():
    h200 = get_hardware("h200", 1, 2)
    assert (h200.name, h200.num_devices, h200.memory_bytes) == ("h200", 2, 141 * GB)
    assert h200.memory_bw > PRESETS["dgx-h100"].memory_bw
    with pytest.raises(ValueError, match=r"unknown topology 'tpu'.*'local'"):
        get_hardware("tpu", 1, 8)
