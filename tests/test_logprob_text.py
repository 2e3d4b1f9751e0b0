"""Chat logprobs of a continued stream: asked by token id (completions' text keys fold two
tokens of the same text), named as vLLM names them (adapters/vllm/logprobtext.py)."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from adapters.codec import chat_logprobs, token_id_of
from adapters.vllm.codec import Codec


def test_token_id_keys():
    assert token_id_of("token_id:17") == 17
    assert token_id_of("token_id:") is None and token_id_of("hello") is None


def test_two_tops_of_the_same_text_stay_two():
    lp = {"tokens": ["token_id:5"], "token_logprobs": [-0.5],
          "top_logprobs": [{"token_id:5": -0.5, "token_id:9": -1.0, "token_id:7": -2.0}]}
    names = {5: "", 9: "", 7: "a"}
    seen = []

    def texts(pos, keys):
        seen.append((pos, keys))
        return [names[token_id_of(k)] for k in keys]

    out = chat_logprobs(lp, 2, 1, texts)["content"][0]
    assert out["token"] == "" and out["bytes"] == [] and out["logprob"] == -0.5
    assert [(t["token"], t["logprob"]) for t in out["top_logprobs"]] == [("", -0.5), ("", -1.0)]
    assert seen == [(0, ["token_id:5", "token_id:5", "token_id:9"])]
    # without names (no tokenizer): the keys as they came
    assert chat_logprobs(lp, 2, 1)["content"][0]["token"] == "token_id:5"


def test_vllm_chat_continuation_asks_ids_only_when_the_router_names_them():
    body = {"model": "m", "messages": [], "logprobs": True, "top_logprobs": 2}
    _, req = Codec().continuation_request("chat", body, [1, 2], [3], text_by_router=True)
    assert req["return_tokens_as_token_ids"] is True and req["logprobs"] == 2
    _, req = Codec().continuation_request("chat", body, [1, 2], [3], text_by_router=False)
    assert "return_tokens_as_token_ids" not in req
    _, req = Codec().continuation_request("chat", {**body, "logprobs": False}, [1, 2], [3],
                                          text_by_router=True)
    assert "return_tokens_as_token_ids" not in req
    # completions' own logprobs are keyed by text in the uninterrupted run too: left so
    _, req = Codec().continuation_request("completions", {"model": "m", "prompt": [1], "logprobs": 2},
                                          [1], [3], text_by_router=True)
    assert "return_tokens_as_token_ids" not in req


def test_names_are_vllms(tiny_model_dir):
    """The port against vLLM's own functions, on random positions and contexts (half of the
    tiny model's byte tokens end in U+FFFD alone and are completed from the context)."""
    pytest.importorskip("vllm")
    from tokenizers import Tokenizer
    from vllm.tokenizers import get_tokenizer
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens
    from vllm.v1.engine.logprobs import LogprobsProcessor

    from adapters.vllm.logprobtext import token_texts

    theirs_tok, ours_tok = get_tokenizer(str(tiny_model_dir)), Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    proc = SimpleNamespace(tokenizer=theirs_tok)
    rng = random.Random(7)
    vocab = ours_tok.get_vocab_size()
    completed = 0
    for _ in range(1000):
        ctx = [rng.randrange(vocab) for _ in range(rng.randrange(7))]
        alts = [rng.randrange(vocab) for _ in range(3)]
        theirs = [LogprobsProcessor._correct_decoded_token(proc, t, ctx[-4:]) if x.endswith("\ufffd") else x
                  for t, x in zip(alts, convert_ids_list_to_tokens(theirs_tok, alts))]
        assert token_texts(ours_tok, alts, ctx) == theirs, (alts, ctx)
        completed += "" in theirs
    assert completed > 100  # the U+FFFD path was exercised
