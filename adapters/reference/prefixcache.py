"""The reference engine's prefix cache: the KV of finished requests, found again by a later
request whose prompt starts with the same token ids (what vLLM's automatic prefix caching and
SGLang's radix cache do; a handoff's warm-up relies on it: docs/handoff.md).

An entry is a token-id sequence and the keys and values of its positions, (layers, n, kv heads,
head dim). A lookup takes the longest common prefix of the prompt with any entry, not only whole
entries: the K/V of position p depend only on the ids at 0..p (model.py: every position is one
`step` over the cache before it), so any shared prefix is valid, and the copied numbers are the
very ones the step would compute (the output is bit-identical with and without a hit:
tests/test_reference_prefix_cache.py). Bounded in tokens held, least recently used out first.
Synchronous, no I/O: the server's one scheduler task and its handlers share one event loop."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

#: the default bound, in tokens (the tiny model's KV is 1 KiB a token: 32 MiB at most)
DEFAULT_TOKENS = 32768


@dataclass
class Entry:
    ids: torch.Tensor  # int64 (n,), on the CPU: compared with prompts
    k: torch.Tensor  # (layers, n, kv heads, head dim), on the model's device
    v: torch.Tensor


class PrefixCache:
    def __init__(self, max_tokens: int = DEFAULT_TOKENS) -> None:
        if max_tokens < 0:
            raise ValueError(f"a prefix cache holds 0 or more tokens, not {max_tokens}")
        self.max_tokens = max_tokens
        self.entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()
        self.tokens = 0  # held, over all entries

    def match(self, ids: list[int]) -> tuple[int, Entry | None]:
        """(n, entry): the longest prefix of `ids` held, n tokens of `entry` (0, None: none);
        that entry becomes the most recently used."""
        if not self.entries or not ids:
            return 0, None
        q = torch.tensor(ids, dtype=torch.int64)
        best, best_key = 0, None
        for key, e in self.entries.items():
            m = min(len(key), len(ids))
            if m <= best:
                continue
            diff = (e.ids[:m] != q[:m]).nonzero()
            n = m if diff.numel() == 0 else int(diff[0])
            if n > best:
                best, best_key = n, key
        if best_key is None:
            return 0, None
        self.entries.move_to_end(best_key)
        return best, self.entries[best_key]

    def put(self, ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Hold the K/V of `ids` (`k`, `v`: (layers, >= len(ids), ...), a request's cache; the
        first len(ids) positions are copied). An entry that `ids` extends is replaced by it; if
        `ids` is a prefix of an entry already held, nothing is added (that one is touched)."""
        n = len(ids)
        if n == 0 or n > self.max_tokens:
            return
        key = tuple(ids)
        for other in list(self.entries):
            if len(other) >= n and other[:n] == key:
                self.entries.move_to_end(other)
                return
            if other == key[:len(other)]:
                self._drop(other)
        self.entries[key] = Entry(torch.tensor(key, dtype=torch.int64), k[:, :n].clone(), v[:, :n].clone())
        self.tokens += n
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self.entries)))

    def _drop(self, key: tuple[int, ...]) -> None:
        del self.entries[key]
        self.tokens -= len(key)

    def clear(self) -> None:
        self.entries.clear()
        self.tokens = 0


__all__ = ["DEFAULT_TOKENS", "Entry", "PrefixCache"]
