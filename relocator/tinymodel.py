"""Generate a tiny random-weight Llama with its own tokenizer, deterministically from a seed.

No model hub is reachable on the reference machines, so the project makes its own model: a
byte-level BPE trained on a generated corpus and a 2-layer Llama in bf16, saved in HF format.
The same seed gives byte-identical files, so the weight hash in a fingerprint is stable.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import shutil
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

DEFAULT_SEED = 0
MODEL_NAME = "tiny-llama"
_WORDS = (
    "the a an of to in on for with at by from cluster node worker model token stream request "
    "router move relocate snapshot restore dump image memory cache page kernel process socket "
    "graph weight layer head key value query batch sequence prompt output fast slow quiet live "
    "red green blue small large bright dark river mountain forest city ocean cloud stone light "
    "run runs ran walk walks speak speaks write writes read reads build builds learn learns "
    "one two three four five six seven eight nine ten hundred thousand and or but not then"
).split()
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    seed: int = DEFAULT_SEED
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 4096

    @property
    def dirname(self) -> str:
        digest = hashlib.sha256(json.dumps(self.__dict__, sort_keys=True).encode()).hexdigest()[:10]
        return f"{MODEL_NAME}-s{self.seed}-{digest}"


def cache_root() -> Path:
    return Path(os.environ.get("RELOCATOR_CACHE_DIR", Path.home() / ".cache" / "relocator"))


def _corpus(seed: int, lines: int = 600) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 24))) for _ in range(lines)]


def _train_tokenizer(spec: TinyModelSpec, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def _write_model(spec: TinyModelSpec, out: Path, vocab_size: int, bos: int, eos: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=bos,
        eos_token_id=eos,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    # Wider than the default init so greedy decoding does not collapse onto one token.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    # Drop volatile fields so the same seed gives byte-identical files.
    gen = out / "generation_config.json"
    if gen.exists():
        data = json.loads(gen.read_text())
        data.pop("transformers_version", None)
        gen.write_text(json.dumps(data, indent=2, sort_keys=True))


#: Serialises generation inside one process. transformers exposes its classes through a lazy
#: module: two threads doing their first `from transformers import X` at once can see a
#: half-initialised module and fail with "cannot import name" (the demo's two parallel launches
#: on a cold cache did).
_GENERATE_LOCK = threading.Lock()


@contextmanager
def _exclusive(lock_file: Path) -> Iterator[None]:
    """One generator at a time across threads and processes (flock on `lock_file`)."""
    with _GENERATE_LOCK, open(lock_file, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _complete(target: Path) -> bool:
    return (target / ".complete").exists()


def ensure_tiny_model(spec: TinyModelSpec | None = None, root: Path | None = None) -> Path:
    """Return the directory of the tiny model, generating it once if needed.

    Safe to call at once from several threads and processes: the first caller builds the model
    in a private temporary folder under a lock and renames it into place; the others wait on
    the lock and find it complete."""
    spec = spec or TinyModelSpec()
    root = root or cache_root() / "models"
    target = root / spec.dirname
    if _complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive(root / f".{spec.dirname}.lock"):
        if _complete(target):  # built by whoever held the lock before us
            return target
        if target.exists():  # an incomplete copy (written in place by an older release)
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{spec.dirname}-", dir=root))
        try:
            _build(spec, tmp)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build(spec: TinyModelSpec, out: Path) -> None:
    _train_tokenizer(spec, out)
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(out)
    _write_model(spec, out, len(tok), tok.bos_token_id, tok.eos_token_id)
    (out / ".complete").write_text(json.dumps(spec.__dict__))


def weight_hash(model_dir: Path) -> str:
    """sha256 over the model's weight files, in name order (the fingerprint's weight hash)."""
    from adapters.base import weights_sha256

    return weights_sha256(model_dir)
