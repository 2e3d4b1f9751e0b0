"""The tiny model is deterministic from its seed and loads with transformers."""

from __future__ import annotations

from pathlib import Path

from relocator.tinymodel import TinyModelSpec, ensure_tiny_model, weight_hash


def test_same_seed_same_bytes_other_seed_differs(tmp_path: Path) -> None:
    a = ensure_tiny_model(TinyModelSpec(seed=7), root=tmp_path / "a")
    b = ensure_tiny_model(TinyModelSpec(seed=7), root=tmp_path / "b")
    c = ensure_tiny_model(TinyModelSpec(seed=8), root=tmp_path / "c")
    assert weight_hash(a) == weight_hash(b)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert weight_hash(a) != weight_hash(c)
    assert ensure_tiny_model(TinyModelSpec(seed=7), root=tmp_path / "a") == a  # cached


def test_loads_and_has_chat_template(tiny_model_dir: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert cfg.model_type == "llama" and cfg.num_hidden_layers == 2
    ids = tok("the cluster node moves")["input_ids"]
    assert tok.decode(ids) == "the cluster node moves"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|assistant|>")
