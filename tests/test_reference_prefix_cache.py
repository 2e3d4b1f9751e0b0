"""The reference engine's prefix cache (adapters/reference/prefixcache.py): bounded, LRU, keyed
by token ids, and invisible in the output: a request that finds its prefix cached produces
exactly the ids (and the very K/V numbers) of one that computed it all."""

from __future__ import annotations

import torch

from adapters.reference.prefixcache import PrefixCache
from adapters.reference.server import Core, Seq


def _kv(n: int, fill: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.arange(n, dtype=torch.float32).view(1, n, 1, 1) + fill
    return t, -t


def test_the_longest_common_prefix_of_any_entry_is_found() -> None:
    c = PrefixCache(100)
    c.put([1, 2, 3, 4], *_kv(4))
    c.put([1, 2, 9, 9, 9], *_kv(5, 100.0))
    n, e = c.match([1, 2, 3, 4, 5, 6])
    assert n == 4 and e is not None and e.ids.tolist() == [1, 2, 3, 4], (n, e)
    n, e = c.match([1, 2, 9, 7])  # a partial entry: its first 3 positions are valid for this prompt
    assert n == 3 and e is not None and e.k[0, :3, 0, 0].tolist() == [100.0, 101.0, 102.0], (n, e)
    assert c.match([5, 1, 2]) == (0, None)
    assert c.match([]) == (0, None)


def test_an_extended_sequence_replaces_its_prefix_and_a_prefix_adds_nothing() -> None:
    c = PrefixCache(100)
    c.put([1, 2, 3], *_kv(3))
    c.put([1, 2, 3, 4, 5], *_kv(5))  # a warm-up round's longer prefill of the same stream
    assert list(c.entries) == [(1, 2, 3, 4, 5)] and c.tokens == 5, c.entries.keys()
    c.put([1, 2], *_kv(2))
    assert list(c.entries) == [(1, 2, 3, 4, 5)] and c.tokens == 5, c.entries.keys()


def test_it_is_bounded_in_tokens_least_recently_used_out_first() -> None:
    c = PrefixCache(10)
    c.put([1, 1, 1, 1], *_kv(4))
    c.put([2, 2, 2, 2], *_kv(4))
    c.match([1, 1, 1, 1, 5])  # 1s used last: 2s are the least recent
    c.put([3, 3, 3, 3], *_kv(4))
    assert list(c.entries) == [(1, 1, 1, 1), (3, 3, 3, 3)] and c.tokens == 8, c.entries.keys()
    c.put(list(range(11)), *_kv(11))  # larger than the whole bound: not held
    assert c.tokens == 8 and len(c.entries) == 2
    assert PrefixCache(0).match([1]) == (0, None)


def _run(core: Core, prompt: list[int], body: dict) -> tuple[list[int], Seq]:
    """Generate synchronously (the server's scheduler, one request); the seq is retired after."""
    seq = core.new_seq(prompt, body)
    while not seq.finished:
        core.step(seq)
    core.retire(seq)
    return seq.out, seq


def test_output_and_kv_are_identical_with_and_without_a_cache_hit(tiny_model_dir) -> None:
    cold = Core(tiny_model_dir, "cpu", 512, prefix_cache_tokens=0)
    warm = Core(tiny_model_dir, "cpu", 512)
    prompt = [5, 17, 42, 99, 3, 250, 8, 77, 31]
    greedy = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
    want, ref = _run(cold, prompt, greedy)
    assert ref.cached == 0 and cold.prefix is None

    # a handoff's warm-up: prompt + 20 ids sent, prefilled (one token out), then the continuation
    # of the same stream from prompt + 23 ids sent (the source ran 3 tokens ahead meanwhile)
    sent = want[:20]
    _run(warm, prompt + sent, {"max_tokens": 1, "temperature": 0})
    got, seq = _run(warm, prompt + want[:23], dict(greedy, max_tokens=17))
    assert seq.cached == len(prompt) + 20, f"cached {seq.cached}, want the prefilled {len(prompt) + 20}"
    assert want[:23] + got == want, (want, got)
    n = len(prompt) + 39  # every position both computed (the last output is never fed back)
    assert torch.equal(seq.cache.k[:, :n], ref.cache.k[:, :n]) and torch.equal(seq.cache.v[:, :n], ref.cache.v[:, :n]), \
        "K/V after a cache hit differ from the ones computed without it"

    # the whole prompt held: its last position is computed all the same (its logits give token 1)
    again, seq = _run(warm, prompt + want[:23], dict(greedy, max_tokens=17))
    assert seq.cached == len(prompt) + 22 and again == got, (seq.cached, again, got)

    # seeded sampling: the same ids with and without the hit (the generator draws only for outputs)
    sampled = {"max_tokens": 24, "temperature": 0.9, "top_p": 0.9, "seed": 7, "ignore_eos": True}
    a, _ = _run(cold, prompt, sampled)
    b, seq = _run(warm, prompt, sampled)
    assert seq.cached == len(prompt) - 1 and a == b, (seq.cached, a, b)
