"""Independent numpy implementations (loops, float64) that the JAX references are checked
against. Kept deliberately naive."""

import numpy as np

# bfloat16 keeps 8 significant bits: neighbouring values are 2**-7 of a value apart at most
# (one ulp), and rounding to the nearest moves a value by at most half of that
BF16_ULP = 2.0**-7
BF16_ROUNDING = 2.0**-8


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
        with np.errstate(invalid="ignore"):  # a NaN or inf bag times 0 is NaN, as intended
            for s in range(num_segments):
                out[s] = out[s] * (1.0 / denom[s] if denom[s] > 0 else 0.0)
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


# --- routed lookups with fixed-capacity buckets (what overflows, and what still arrives) ---


def _columns(d, c, k):
    w = d // c
    return slice(k * w, (k + 1) * w)


def _pooled_out(features, ids, tables):
    out = {}
    for f, t, combiner in features:
        b, h = ids[f].shape
        d = tables[t].shape[1]
        out[f] = np.zeros((b, h, d) if combiner == "none" else (b, d))
    return out


def _add(out, combiner, sample, h, cols, vec):
    if combiner == "none":
        out[sample, h, cols] += vec
    else:
        out[sample, cols] += vec


def rb_lookup(tables, devices, features, ids, num_devices, capacity):
    """Sum-pooled RB lookup with per-destination buckets of `capacity` request slots.

    `devices[t]` is the table's `[c][r]` devices (id x goes to row shard x % r);
    `features` lists `(feature, table, combiner)` in the group's order. Every source device
    sends, feature after feature and column slice after column slice, one request per valid
    id in flat order; a destination keeps the first `capacity` requests from each source.
    Returns `(outputs, lost per table)`: the outputs hold every column slice that arrived;
    an id occurrence is lost when any of its column slices did not.
    """
    out = _pooled_out(features, ids, tables)
    lost = {t: 0 for _, t, _ in features}
    b = next(iter(ids.values())).shape[0] // num_devices
    for s in range(num_devices):
        fill = np.zeros(num_devices, np.int64)
        for f, t, combiner in features:
            dev, table = devices[t], np.asarray(tables[t], np.float64)
            c, r = len(dev), len(dev[0])
            local = np.asarray(ids[f])[s * b : (s + 1) * b]
            kept = np.ones((*local.shape, c), bool)
            for k in range(c):
                for (i, h), x in np.ndenumerate(local):
                    if x < 0:
                        continue
                    dst = dev[k][x % r]
                    kept[i, h, k] = fill[dst] < capacity
                    fill[dst] += 1
                    if kept[i, h, k]:
                        cols = _columns(table.shape[1], c, k)
                        _add(out[f], combiner, s * b + i, h, cols, table[x, cols])
            lost[t] += int(((local >= 0) & ~kept.all(axis=-1)).sum())
    return out, lost


def ub_lookup(tables, devices, features, ids, num_devices, capacity, unique_capacity):
    """UB lookup: each source dedups each table's ids (ascending, the first
    `unique_capacity[t]` kept), then sends table after table, column slice after column
    slice, one request per unique id; destinations keep the first `capacity` per source.
    Every occurrence of a unique id gets the column slices that arrived (sum or copy);
    it is lost when its id found no dedup slot or any column slice did not arrive.
    """
    out = _pooled_out(features, ids, tables)
    order = list(dict.fromkeys(t for _, t, _ in features))
    lost = {t: 0 for t in order}
    b = next(iter(ids.values())).shape[0] // num_devices
    for s in range(num_devices):
        fill = np.zeros(num_devices, np.int64)
        arrived = {}
        for t in order:
            dev = devices[t]
            local = [np.asarray(ids[f])[s * b : (s + 1) * b] for f, tt, _ in features if tt == t]
            uniq = sorted({int(x) for a in local for x in a.reshape(-1) if x >= 0})
            uniq = uniq[: unique_capacity[t]]
            for k in range(len(dev)):
                for x in uniq:
                    dst = dev[k][x % len(dev[0])]
                    arrived[t, k, x] = fill[dst] < capacity
                    fill[dst] += 1
        for f, t, combiner in features:
            dev, table = devices[t], np.asarray(tables[t], np.float64)
            c = len(dev)
            local = np.asarray(ids[f])[s * b : (s + 1) * b]
            for (i, h), x in np.ndenumerate(local):
                if x < 0:
                    continue
                got = [arrived.get((t, k, int(x)), False) for k in range(c)]
                lost[t] += not all(got)
                for k in range(c):
                    if got[k]:
                        cols = _columns(table.shape[1], c, k)
                        _add(out[f], combiner, s * b + i, h, cols, table[x, cols])
    return out, lost
