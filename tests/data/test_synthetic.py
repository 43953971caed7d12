import numpy as np
import pytest

from embark_jax import EmbeddingConfig, FeatureConfig, TableConfig
from embark_jax.data.synthetic import SyntheticDataset, zipf_ranks

CFG = EmbeddingConfig.create(
    [
        TableConfig(name="big", vocab_size=100_000, dim=8),
        TableConfig(name="small", vocab_size=50, dim=4),
    ],
    [
        FeatureConfig(name="f_big", table="big", max_hotness=8),
        FeatureConfig(name="f_small", table="small", max_hotness=1),
    ],
)


def test_zipf_ranks_follow_the_power_law():
    rng = np.random.default_rng(0)
    alpha, vocab = 1.1, 1_000_000
    r = zipf_ranks(rng, alpha, vocab, 2_000_000)
    assert r.min() >= 0 and r.max() < vocab
    counts = np.bincount(r, minlength=vocab).astype(float)
    # log-log slope of frequency vs rank over ranks 10..1000 is close to -alpha
    ranks = np.arange(10, 1000)
    slope = np.polyfit(np.log(ranks + 1), np.log(counts[ranks] + 1e-9), 1)[0]
    assert abs(slope + alpha) < 0.1, slope
    # the skew is real: the hottest 1% of ids carry most of the traffic (uniform: 1%)
    assert counts[: vocab // 100].sum() / counts.sum() > 0.5


def test_ids_are_permuted_and_rank_is_invertible():
    ds = SyntheticDataset(CFG, batch_size=4096, seed=3)
    ids = ds.ids(np.random.default_rng(1), "big", 20000)
    ranks = ds.rank_of("big", ids)
    assert ranks.min() >= 0 and ranks.max() < 100_000
    # the hottest ids are not simply 0, 1, 2, ... (per-table permutation)
    vals, counts = np.unique(ids, return_counts=True)
    top = vals[np.argsort(-counts)[:5]]
    assert not set(top.tolist()) <= set(range(10))
    # and the hottest id maps back to rank 0
    assert ds.rank_of("big", top[:1])[0] == 0


def test_batches_are_deterministic_and_streamed():
    a = SyntheticDataset(CFG, batch_size=64, seed=5)
    b = SyntheticDataset(CFG, batch_size=64, seed=5)
    x, y = a.batch(7), b.batch(7)
    np.testing.assert_array_equal(x.sparse.ids["f_big"], y.sparse.ids["f_big"])
    np.testing.assert_array_equal(x.labels, y.labels)
    z = a.batch(8)
    assert not np.array_equal(x.sparse.ids["f_big"], z.sparse.ids["f_big"])
    got = [bt.labels for bt in a.batches(start=7, num=2)]
    np.testing.assert_array_equal(got[0], x.labels)
    assert x.dense.shape == (64, 13) and x.sparse.ids["f_big"].shape == (64, 8)


def test_varying_lengths():
    ds = SyntheticDataset(CFG, batch_size=500, seed=1, varying_lengths=True)
    lens = np.asarray(ds.batch(0).sparse.lengths["f_big"])
    assert lens.min() >= 1 and lens.max() <= 8 and len(set(lens.tolist())) > 4


def test_labels_depend_on_ids_and_are_balanced():
    ds = SyntheticDataset(CFG, batch_size=20_000, seed=2)
    bt = ds.batch(0)
    assert 0.2 < bt.labels.mean() < 0.8
    # the teacher uses the small table's ids: per-id label rates differ strongly
    ids = np.asarray(bt.sparse.ids["f_small"])[:, 0]
    rates = np.array([bt.labels[ids == i].mean() for i in np.unique(ids) if (ids == i).sum() > 100])
    assert rates.max() - rates.min() > 0.2


def test_dynamic_features_are_the_same_ids_as_key_words():
    plain = SyntheticDataset(CFG, batch_size=64, seed=5, varying_lengths=True)
    dyn = SyntheticDataset(
        CFG, batch_size=64, seed=5, varying_lengths=True, dynamic_features=["f_big"]
    )
    assert [t.name for t in dyn.fixed_config.tables] == ["small"]
    x, y = plain.batch(3), dyn.batch(3)
    assert sorted(y.sparse.ids) == ["f_small"] and sorted(y.dynamic) == ["f_big"]
    words = y.dynamic["f_big"]
    assert words.dtype == np.uint32 and words.shape == (64, 8, 2)
    ids = x.sparse.ids["f_big"].astype(np.int64)  # -1 in empty slots: all-ones words
    np.testing.assert_array_equal(words[..., 0], ids.view(np.uint64).astype(np.uint32))
    np.testing.assert_array_equal(words[..., 1], (ids.view(np.uint64) >> 32).astype(np.uint32))
    assert (ids == -1).any() and (words[ids == -1] == 0xFFFFFFFF).all()
    np.testing.assert_array_equal(x.labels, y.labels)
    np.testing.assert_array_equal(x.sparse.ids["f_small"], y.sparse.ids["f_small"])
    with pytest.raises(ValueError, match=r"dynamic_features \['nope'\] are not features"):
        SyntheticDataset(CFG, batch_size=8, dynamic_features=["nope"])
