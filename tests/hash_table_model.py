"""A pure-Python model of one shard of a dynamic table's hash table (docs/design.md §11).

Plain Python ints, lists and dicts, written from the rules as design §11 states them and
independently of the kernels and of the `jnp` reference (its own hash, on Python ints): the
tests compare both with it, call by call, slot by slot and entry by entry.

Each bucket is a list of `bucket_size` entries; an entry is None (empty) or a dict
`{"key", "last", "seen"}`; the candidates of a bucket are a list of `candidates` such entries.
"""

from __future__ import annotations

import numpy as np

M32 = 0xFFFFFFFF
PAD = (1 << 64) - 1  # the all-ones id: padding
ROUND_KEYS = (0x9E3779B9, 0x7F4A7C15, 0xF39CC060, 0x5CED1B1B)
MAX_COUNT = 2**31 - 1
COUNT_NAMES = ("found", "inserted", "evicted", "expired", "refused", "dropped")


def mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def hash64(key: int) -> tuple[int, int]:
    """The id hash: a 4-round Feistel network on (low, high) with mix32 as round function."""
    left, right = key & M32, key >> 32
    for k in ROUND_KEYS:
        left, right = right, left ^ mix32(right ^ k)
    return left, right


class HashTableModel:
    def __init__(
        self,
        *,
        num_buckets: int,
        bucket_size: int,
        eviction: str = "lru",
        threshold: int = 1,
        candidates: int = 0,
        ttl: int = 0,
    ):
        self.num_buckets, self.bucket_size = num_buckets, bucket_size
        self.eviction, self.threshold, self.candidates, self.ttl = (
            eviction,
            threshold,
            candidates,
            ttl,
        )
        self.buckets = [[None] * bucket_size for _ in range(num_buckets)]
        self.cands = [[None] * candidates for _ in range(num_buckets)]
        self.step = 0

    @classmethod
    def for_config(cls, config) -> HashTableModel:
        return cls(
            num_buckets=config.num_buckets,
            bucket_size=config.bucket_size,
            eviction=config.eviction.value,
            threshold=config.admission_threshold,
            candidates=config.admission_candidates,
            ttl=config.ttl,
        )

    def bucket(self, key: int) -> int:
        return hash64(key)[0] % self.num_buckets

    def _live(self, entry, step: int) -> bool:
        return entry is not None and (self.ttl == 0 or step - entry["last"] <= self.ttl)

    # --- the two operations -------------------------------------------------------------

    def find(self, ids: list[int]) -> list[int]:
        """Slot of each id's live entry at the latest step, -1 if none."""
        out = []
        for key in ids:
            slot = -1
            if key != PAD:
                b = self.bucket(key)
                for j, e in enumerate(self.buckets[b]):
                    if self._live(e, self.step) and e["key"] == key:
                        slot = b * self.bucket_size + j
                        break
            out.append(slot)
        return out

    def find_or_insert(self, ids: list[int], step: int):
        """Returns (slots, inserted flags, counts dict); processes the ids in order."""
        self.step = step
        counts = dict.fromkeys(COUNT_NAMES, 0)
        slots, inserted = [], []
        for key in ids:
            slot, new = self._one(key, step, counts)
            slots.append(slot)
            inserted.append(new)
        return slots, inserted, counts

    def _one(self, key: int, step: int, counts: dict) -> tuple[int, bool]:
        if key == PAD:
            return -1, False
        b = self.bucket(key)
        entries = self.buckets[b]
        for j, e in enumerate(entries):
            if self._live(e, step) and e["key"] == key:
                e["last"], e["seen"] = step, min(e["seen"] + 1, MAX_COUNT)
                counts["found"] += 1
                return b * self.bucket_size + j, False
        seen, cand = 1, None
        if self.threshold > 1:
            cands = self.cands[b]
            cand = next(
                (j for j, c in enumerate(cands) if self._live(c, step) and c["key"] == key), None
            )
            if cand is not None:
                seen = min(cands[cand]["seen"] + 1, MAX_COUNT)
            else:
                free = [j for j, c in enumerate(cands) if not self._live(c, step)]
                if free:
                    cand = free[0]
                else:  # forget the candidate seen longest ago (then: fewest sightings)
                    cand = min(
                        range(len(cands)), key=lambda j: (cands[j]["last"], cands[j]["seen"], j)
                    )
            cands[cand] = {"key": key, "last": step, "seen": seen}
            if seen < self.threshold:
                counts["refused"] += 1
                return -1, False
        free = [j for j, e in enumerate(entries) if not self._live(e, step)]
        if free:
            j = free[0]
            if entries[j] is not None:
                counts["expired"] += 1
        else:
            evictable = [j for j, e in enumerate(entries) if e["last"] < step]
            if self.eviction == "none" or not evictable:
                counts["dropped"] += 1
                return -1, False
            if self.eviction == "lru":
                j = min(evictable, key=lambda j: (entries[j]["last"], j))
            else:
                j = min(evictable, key=lambda j: (entries[j]["seen"], entries[j]["last"], j))
            counts["evicted"] += 1
        entries[j] = {"key": key, "last": step, "seen": seen}
        if cand is not None:
            self.cands[b][cand] = None
        counts["inserted"] += 1
        return b * self.bucket_size + j, True

    # --- the state in the kernels' layout -----------------------------------------------

    def arrays(self) -> dict[str, np.ndarray]:
        """keys / scores / cand_keys / cand_scores as the kernels lay them out."""

        def lay(groups):
            flat = [e for g in groups for e in g]
            keys = np.full((len(flat), 2), M32, np.uint32)
            scores = np.zeros((len(flat), 2), np.int32)
            for i, e in enumerate(flat):
                if e is not None:
                    keys[i] = (e["key"] & M32, e["key"] >> 32)
                    scores[i] = (e["last"], e["seen"])
            return keys, scores

        keys, scores = lay(self.buckets)
        ckeys, cscores = lay(self.cands)
        return {"keys": keys, "scores": scores, "cand_keys": ckeys, "cand_scores": cscores}

    def live_keys(self) -> dict[int, int]:
        """key -> slot of every live entry at the latest step."""
        return {
            e["key"]: b * self.bucket_size + j
            for b, entries in enumerate(self.buckets)
            for j, e in enumerate(entries)
            if self._live(e, self.step)
        }
