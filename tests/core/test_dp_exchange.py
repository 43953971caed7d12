"""The DP exchange rule (`core.dp_exchange`): words over links and through memory."""

import pytest

from embark_jax.core import dp_exchange as X


def test_sparse_bytes_count_id_slots_and_pooled_gradients():
    # 12 bytes per id slot (row, bag, scale), 4 per gradient element
    assert X.sparse_bytes_per_device(100, 10, 8) == 100 * 12 + 10 * 8 * 4


@pytest.mark.parametrize("rows", [5_000, 100_000, 4_000_000])
def test_one_device_never_densifies_a_table_the_batch_touches_sparsely(rows):
    """One device, batch 4096 x 8 ids: no link is used, so a dense gradient is only local
    work, V x d written and read, against the batch's own gradients."""
    assert not X.dense_wins(rows, 64, 4096 * 8, 4096, 1)


def test_a_tiny_table_goes_dense_on_one_device_and_on_many():
    assert X.dense_wins(3, 64, 4096 * 8, 4096, 1)
    assert X.dense_wins(16, 16, 8 * 4, 8, 8)


def test_the_exact_boundary_on_eight_devices():
    """dense 2 V (d + 1) + 2 V d against 2 G (3 b H + b d) words: b = 8, H = 4, d = 16, G = 8
    gives 3584 sparse words; V = 54 is 3564 dense words, V = 55 is 3630."""
    assert X.dense_wins(54, 16, 32, 8, 8)
    assert not X.dense_wins(55, 16, 32, 8, 8)
