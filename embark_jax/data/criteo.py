"""Criteo click logs: the Kaggle / Terabyte TSV files and the MLPerf DLRM-DCNv2 multi-hot
numpy layout, as datasets `fit` can train on (`batch(step) -> Batch`, `batch_size`).

Both readers map the 26 categorical columns, in order, to the config's 26 features (the
preset's order: column j feeds `config.features[j]` and its table), and serve fixed-size
global batches as a pure function of the step: sample `(step * B + i) mod N` is row i of
batch `step` (N samples, wrapping around at the end of the data), so `batch(step)` is the
same after a restart, for any number of processes and with or without prefetching.

**TSV** (`CriteoTSV`, Kaggle Display Advertising `train.txt` and Terabyte `day_N`): one
sample per line, 40 tab-separated fields: the label (`0` or `1`), 13 integer features
(decimal, optionally negative, at most 18 digits) and 26 categorical features (hexadecimal,
at most 16 digits, any case). Any dense or categorical field may be empty (missing).

  - dense value x -> `log(1 + max(x, 0))` as float32; missing -> 0.
  - categorical hex h -> `int(h, 16) mod vocab_size` of the feature's table (modulo, no
    hash); missing -> 0 (as TorchRec's Criteo preprocessing), so every bag holds one id;
    the remaining `max_hotness - 1` slots are padding.
  - bad rows are skipped whole and counted by reason (`bad_rows`): `field_count` (not 40
    fields: never re-aligned, so columns never shift), `label` (not 0/1), `dense` (not a
    decimal integer), `categorical` (not hexadecimal). The first few line numbers are kept
    (`bad_examples`).

Random access uses an index of the good lines' byte offsets and lengths, built once by one
pass over the file at construction (every process builds it: it is what tells which lines
are samples); `index_cache=PATH` stores it and reuses it while the file's size and mtime are
unchanged. Batches are read with `os.pread` (thread-safe) from the file as it was opened
for indexing; each batch first checks that its size and mtime are those indexed, and a line
that no longer parses is a `DataError` naming the file and the line: a file written to after
it was indexed is refused, never read at stale offsets.

**Multi-hot** (`CriteoMultiHot`, the MLPerf DLRMv2 preprocessed dataset, as TorchRec's
`materialize_synthetic_multihot_dataset.py` writes it): a directory holding, per day X,
  - `day_X_labels.npy`: labels, shape `[N]` or `[N, 1]`, integer or float, 0/1;
  - `day_X_dense.npy`: `[N, 13]` dense features, already transformed by the preprocessing
    (used as they are, cast to float32);
  - `day_X_sparse_multi_hot.npz` (an `np.savez` archive with members `0.npy` ... `25.npy`),
    or the same members unpacked in a directory `day_X_sparse_multi_hot_unpacked/`: member
    j is `[N, hotness_j]` (or `[N]` for hotness 1) integer ids of categorical feature j.
Days are taken in numeric order of X (all days found, or `days=`) and concatenated. Ids are
mapped `id mod vocab_size` of the feature's table (the files' ids are already below the
full-size vocabularies; the modulo matters for `-mini` presets and `--max-vocab`); a bag
wider than the feature's `max_hotness` keeps its first `max_hotness` ids, a narrower one is
padded; a negative id is treated as an empty slot and counted (`bad_rows["negative_id"]`).
Labels and dense features are checked as a batch reads them: a label that is not 0 or 1, or
a dense value that is not a finite float32 number, is a `DataError` naming the file, the row
(within its day) and the value; a file shorter than its header says (truncated) is refused
at construction, naming the file, the day and the feature.
Uncompressed archive members and `.npy` files are memory-mapped (only the rows of a batch are
read); a compressed member is loaded whole into memory.

**Dynamic tables** (`dynamic=DynamicConfig`, `columns=`): `columns` names the feature each
of the 26 columns feeds, in column order (default: the config's features, then the dynamic
ones); a dynamic table's column is not mapped: the TSV's hex value as a 64-bit id, the
multi-hot files' ids as they are, served as `Batch.dynamic[name]` uint32 words `[B, H, 2]`
(`core.dynamic.key_words`; empty slots and other processes' rows are all ones, padding).
The all-ones id (hex `ffffffffffffffff`) is padding and reads zeros.

**Processes.** With `process_count` n (from `jax.process_count()`), process p reads only
rows `[p * B/n, (p + 1) * B/n)` of every global batch: `local_batch(step)`. `batch(step)`
is the global-shaped batch the current `StepRunner` expects (it keeps each process's own
rows): this process's rows in place, the others' rows empty (padding ids, zero dense
features) but with their labels (cheap: from the index or the labels file), so host-side
metrics over the global batch stay right. With one process both are the full batch.

**Prefetch.** `batch(step)` also starts building batch `step + 1` in a background thread
(`embark_jax.data.prefetch.Prefetcher`), so reading and parsing overlap the step.
"""

from embark_jax.data.criteo_base import (
    NUM_CATEGORICAL,
    NUM_DENSE,
    BadRow,
    dense_transform,
    parse_tsv_line,
)
from embark_jax.data.criteo_multihot import CriteoMultiHot
from embark_jax.data.criteo_tsv import CriteoTSV

__all__ = [
    "NUM_CATEGORICAL",
    "NUM_DENSE",
    "BadRow",
    "CriteoMultiHot",
    "CriteoTSV",
    "dense_transform",
    "parse_tsv_line",
]
