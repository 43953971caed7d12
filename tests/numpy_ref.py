"""Independent numpy implementations (loops, float64) that the JAX references are checked
against. Kept deliberately naive."""

import numpy as np


def segment_sum(values, seg, num_segments):
    out = np.zeros((num_segments, *values.shape[1:]), np.float64)
    for i, s in enumerate(seg):
        if 0 <= s < num_segments:
            out[s] += values[i]
    return out


def lookup_pool(table, ids, seg, num_segments, weights=None, combiner="sum"):
    table = np.asarray(table, np.float64)
    n, d = len(ids), table.shape[1]
    w = np.ones(n) if weights is None else np.asarray(weights, np.float64)
    if combiner == "none":
        out = np.zeros((n, d))
        for i, x in enumerate(ids):
            if 0 <= x < table.shape[0]:
                out[i] = w[i] * table[x]
        return out
    out = np.zeros((num_segments, d))
    denom = np.zeros(num_segments)
    for i, x in enumerate(ids):
        if 0 <= x < table.shape[0] and 0 <= seg[i] < num_segments:
            out[seg[i]] += w[i] * table[x]
            denom[seg[i]] += w[i] if combiner == "mean" else w[i] ** 2
    if combiner == "sqrtn":
        denom = np.sqrt(denom)
    if combiner in ("mean", "sqrtn"):
        for s in range(num_segments):
            out[s] = out[s] / denom[s] if denom[s] > 0 else 0.0
    return out


def unique(ids, capacity):
    vals = sorted({int(x) for x in ids if x >= 0})
    uniq = np.full(capacity, -1, np.int64)
    counts = np.zeros(capacity, np.int64)
    slot = {v: i for i, v in enumerate(vals)}
    inverse = np.full(len(ids), -1, np.int64)
    for i, x in enumerate(ids):
        if x >= 0 and slot[int(x)] < capacity:
            inverse[i] = slot[int(x)]
            counts[slot[int(x)]] += 1
    for v, i in slot.items():
        if i < capacity:
            uniq[i] = v
    return uniq, inverse, counts, len(vals)
