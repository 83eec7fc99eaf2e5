"""Reply lengths of near-duplicate prompts.

The same prompt often comes back: a user regenerates a reply, a conversation
is shared and continued twice, a client retries. The reply length last time
is then the best guess for this time, better than any model of the text: on
ShareGPT's dev turns whose prompt is a near-duplicate of an earlier one, the
earlier reply's length is off by about 19 tokens where the text model is
off by about 61 (``benchmarks/lifetime_study.py``). An exact hash of the
prompt finds too few of them (an edited word, one more turn), so prompts are
compared by the Jaccard similarity of their token 6-grams, estimated by
MinHash and found through locality-sensitive hashing (Broder 1997; Indyk and
Motwani 1998), as near-duplicate detection in web crawls does.

Only the last ``window`` prompt tokens are compared: that is the new message
and the end of the conversation before it, which decide the reply.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SHINGLE = 6
#: Multiplier of the rolling hash that makes a 6-gram one 64-bit number.
_ROLL = np.uint64(1_000_003)


class NearDuplicates:
    """Remembers ``value`` (a reply's log length) under the MinHash signature
    of a prompt, and answers the value of the most similar remembered prompt.

    ``perms`` MinHash values per prompt, split into ``bands`` bands: two
    prompts are compared only where a whole band agrees. With 8 bands of 8,
    a pair of similarity 0.95 is missed once in about 6,000, one of 0.9
    once in about 90. The newest ``capacity`` prompts are kept."""

    def __init__(self, capacity: int = 100_000, window: int = 512, perms: int = 64, bands: int = 8, seed: int = 0):
        if perms % bands:
            raise ValueError(f"near duplicates: {perms} permutations do not split into {bands} bands")
        rng = np.random.default_rng(seed)
        # Multiply-shift hashing: the high 32 bits of a*x + b (mod 2**64), a odd.
        self._a = rng.integers(1, 1 << 63, perms, dtype=np.uint64) | np.uint64(1)
        self._b = rng.integers(0, 1 << 63, perms, dtype=np.uint64)
        self.capacity = capacity
        self.window = window
        self.bands = bands
        self._rows = perms // bands
        self._signatures = np.zeros((min(capacity, 1024), perms), dtype=np.uint32)
        self._values = np.zeros(len(self._signatures))
        self._added = 0
        #: Per band: band bytes -> the slots of the newest prompts with it
        #: (each slot is in one bucket a band, so this is bounded too).
        self._buckets: list[dict[bytes, list[int]]] = [{} for _ in range(bands)]

    def signature(self, tokens: Sequence[int]) -> np.ndarray:
        t = np.asarray(tokens[-self.window :], dtype=np.int64).astype(np.uint64)
        if len(t) < SHINGLE:
            t = np.concatenate([t, np.zeros(SHINGLE - len(t), dtype=np.uint64)])
        n = len(t) - SHINGLE + 1
        grams = t[:n] * _ROLL
        for k in range(1, SHINGLE):
            grams += t[k : k + n]
            if k < SHINGLE - 1:
                grams *= _ROLL
        # The minimum of each hash over the 6-grams (a repeated 6-gram changes
        # no minimum), its high 32 bits: taken after the minimum, as the
        # shift keeps the order.
        hashes = np.multiply.outer(self._a, grams)
        hashes += self._b[:, None]
        return (hashes.min(1) >> np.uint64(32)).astype(np.uint32)

    def _bands(self, signature: np.ndarray):
        for band in range(self.bands):
            yield band, signature[band * self._rows : (band + 1) * self._rows].tobytes()

    def nearest(self, signature: np.ndarray) -> tuple[float, float] | None:
        """(estimated similarity, value) of the most similar remembered
        prompt, the newest among equals; None if none shares a band."""
        slots: set[int] = set()
        for band, key in self._bands(signature):
            slots.update(self._buckets[band].get(key, ()))
        if not slots:
            return None
        ids = np.fromiter(slots, dtype=np.int64, count=len(slots))
        # Newest first, so that argmax keeps the newest of equally similar ones.
        newest = (self._added - 1) % self.capacity
        ids = ids[np.argsort((newest - ids) % self.capacity, kind="stable")]
        similarity = (self._signatures[ids] == signature).mean(1)
        best = int(np.argmax(similarity))
        return float(similarity[best]), float(self._values[ids[best]])

    def add(self, signature: np.ndarray, value: float) -> None:
        slot = self._added % self.capacity
        if slot >= len(self._signatures):  # grow by doubling up to capacity
            size = min(self.capacity, 2 * len(self._signatures))
            self._signatures = np.resize(self._signatures, (size, self._signatures.shape[1]))
            self._values = np.resize(self._values, size)
        if self._added >= self.capacity:
            self._forget(slot)
        self._signatures[slot] = signature
        self._values[slot] = value
        self._added += 1
        for band, key in self._bands(signature):
            members = self._buckets[band].setdefault(key, [])
            members.append(slot)
            del members[:-16]  # a common prompt's bucket keeps its newest

    def _forget(self, slot: int) -> None:
        """Drop the slot about to be overwritten from its buckets."""
        for band, key in self._bands(self._signatures[slot]):
            members = self._buckets[band].get(key)
            if members is not None:
                members[:] = [s for s in members if s != slot]
                if not members:
                    del self._buckets[band][key]

    def __len__(self) -> int:
        return min(self._added, self.capacity)
