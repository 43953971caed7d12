"""How a DP (replicated) group exchanges its gradients: the one rule the runtime runs
(`sharding.clusters.dp`) and the planner prices (`planner.cost`, `planner.traffic`).

Every device of a DP group holds the whole stacked buffer `[rows, width]` and looks up its
own samples. Per step it has `id_slots` id slots (one per id of its samples, padding
included) and `grad_rows` output gradient rows (one per sample and pooled feature, one per
id slot of a sequence feature). The update must be the same on every replica, so the
gradients are exchanged in one of two ways:

- **sparse**: an all-gather of every device's id slots (row, bag, scale: three 4-byte
  words each) and its float32 output gradient rows; every device then runs the fused
  backward + optimizer over all of them (duplicates merged in the kernel). Nothing of size
  ids x width is written.
- **dense**: each device sums its gradients into a `[rows, width]` float32 array, an
  all-reduce adds them up (with a touched count per row), and the update reads every row.

`dense_wins` picks by the words each way moves over the links and through local memory
(4-byte words; one link word and one memory word count alike): links, the all-reduce (2
rows (width + 1), as a ring) or the all-gather's result (G per-device contributions);
memory, the dense gradient written and read (2 rows width) or the gathered gradients and id
slots read by the kernel. On one device no link is used and the sparse way wins unless the
table has fewer rows than the batch has gradient rows (a tiny table).
"""

from __future__ import annotations

__all__ = ["ID_SLOT_BYTES", "dense_wins", "sparse_bytes_per_device"]

# the sparse exchange's per id slot: its row, its bag (output gradient row) and its scale
ID_SLOT_BYTES = 12


def sparse_bytes_per_device(id_slots: float, grad_rows: float, width: int) -> float:
    """Bytes one device contributes to the sparse exchange's all-gather."""
    return id_slots * ID_SLOT_BYTES + grad_rows * width * 4


def _dense_words(rows: float, width: int, num_devices: int) -> float:
    links = 2 * rows * (width + 1) if num_devices > 1 else 0.0
    return links + 2 * rows * width


def _sparse_words(id_slots: float, grad_rows: float, width: int, num_devices: int) -> float:
    gathered = num_devices * sparse_bytes_per_device(id_slots, grad_rows, width) / 4
    return gathered * (2 if num_devices > 1 else 1)  # over the links, then read


def dense_wins(
    rows: float, width: int, id_slots: float, grad_rows: float, num_devices: int
) -> bool:
    """`DPGradients.AUTO`: True when the dense exchange moves fewer words than the sparse one
    (module doc). `id_slots` and `grad_rows` are one device's."""
    dense = _dense_words(rows, width, num_devices)
    return dense < _sparse_words(id_slots, grad_rows, width, num_devices)
