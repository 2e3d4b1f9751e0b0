"""The tiny Llama's forward pass in plain torch, one token at a time (the reference engine's core).

Synchronous and pure: no I/O, no event loop. Weights are read from the model folder's
safetensors files (parsed here: the format is an 8-byte header length, a JSON header and raw
tensors, so the server needs neither `safetensors` nor `transformers`) and computed in float32.

Every token, prompt or output, goes through the same `step`: one position, written into the
request's own static KV cache, attention over the cache up to that position. The numbers for a
position therefore depend only on the token ids before it, never on batch shape, on how the
prompt was split, or on what other requests run: a request continued elsewhere from its prompt
ids plus the ids already sent produces exactly the ids of the uninterrupted run."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of one .safetensors file (BF16/F16/F32), as float32 on the CPU."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out: dict[str, torch.Tensor] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        dtype = _DTYPES[meta["dtype"]]
        raw = bytearray(data[base + start: base + end])
        t = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        out[name] = t.reshape(meta["shape"]).to(torch.float32)
    return out


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_id: int | None

    @classmethod
    def from_file(cls, path: Path) -> "LlamaConfig":
        c = json.loads(Path(path).read_text())
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        if rope.get("rope_type", "default") not in ("default", None):
            raise ValueError(f"rope type {rope.get('rope_type')!r} is not supported")
        heads = c["num_attention_heads"]
        eos = c.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                   intermediate_size=c["intermediate_size"],
                   num_layers=c["num_hidden_layers"], num_heads=heads,
                   num_kv_heads=c.get("num_key_value_heads", heads),
                   head_dim=c.get("head_dim") or c["hidden_size"] // heads,
                   rms_norm_eps=c.get("rms_norm_eps", 1e-6),
                   rope_theta=rope.get("rope_theta", c.get("rope_theta", 10000.0)),
                   max_position_embeddings=c.get("max_position_embeddings", 2048),
                   bos_token_id=c.get("bos_token_id"), eos_token_id=eos)


class KVCache:
    """One request's keys and values: (layers, positions, kv heads, head dim), allocated once."""

    def __init__(self, cfg: LlamaConfig, max_len: int, device: torch.device) -> None:
        shape = (cfg.num_layers, max_len, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=torch.float32, device=device)
        self.v = torch.zeros(shape, dtype=torch.float32, device=device)
        self.max_len = max_len


class Llama:
    """LlamaForCausalLM's forward (RMSNorm, rotary embeddings, GQA attention, SiLU MLP)."""

    def __init__(self, model_dir: Path, device: str = "cpu") -> None:
        model_dir = Path(model_dir)
        self.cfg = cfg = LlamaConfig.from_file(model_dir / "config.json")
        self.device = torch.device(device)
        w: dict[str, torch.Tensor] = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            w.update(load_safetensors(f))
        w = {k: v.to(self.device) for k, v in w.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.norm = w["model.norm.weight"]
        self.lm_head = w.get("lm_head.weight", self.embed)
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            self.layers.append({
                "in_norm": w[p + "input_layernorm.weight"],
                "post_norm": w[p + "post_attention_layernorm.weight"],
                "q": w[p + "self_attn.q_proj.weight"],
                "k": w[p + "self_attn.k_proj.weight"],
                "v": w[p + "self_attn.v_proj.weight"],
                "o": w[p + "self_attn.o_proj.weight"],
                "gate": w[p + "mlp.gate_proj.weight"],
                "up": w[p + "mlp.up_proj.weight"],
                "down": w[p + "mlp.down_proj.weight"],
            })
        hd = cfg.head_dim
        self.inv_freq = 1.0 / (cfg.rope_theta ** (
            torch.arange(0, hd, 2, dtype=torch.float32, device=self.device) / hd))
        self.group = cfg.num_heads // cfg.num_kv_heads
        self.scale = hd ** -0.5

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache(self.cfg, max_len, self.device)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps))

    def _rope(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        freqs = pos * self.inv_freq
        emb = torch.cat((freqs, freqs))
        cos, sin = emb.cos(), emb.sin()
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    @torch.inference_mode()
    def step(self, token: int, pos: int, cache: KVCache) -> torch.Tensor:
        """Logits (float32, vocab) after `token` at position `pos`; writes its K/V at `pos`."""
        cfg = self.cfg
        if pos >= cache.max_len:
            raise ValueError("KV cache full")
        x = self.embed[token]
        for li, L in enumerate(self.layers):
            h = self._rms(x, L["in_norm"])
            q = (L["q"] @ h).view(cfg.num_heads, cfg.head_dim)
            k = (L["k"] @ h).view(cfg.num_kv_heads, cfg.head_dim)
            v = (L["v"] @ h).view(cfg.num_kv_heads, cfg.head_dim)
            q, k = self._rope(q, pos), self._rope(k, pos)
            cache.k[li, pos] = k
            cache.v[li, pos] = v
            keys = cache.k[li, : pos + 1].transpose(0, 1)  # (kv heads, T, hd)
            vals = cache.v[li, : pos + 1].transpose(0, 1)
            qg = q.view(cfg.num_kv_heads, self.group, cfg.head_dim)  # GQA: heads per kv head
            att = torch.softmax((qg @ keys.transpose(1, 2)) * self.scale, dim=-1)  # (kv, g, T)
            o = (att @ vals).reshape(cfg.num_heads * cfg.head_dim)
            x = x + L["o"] @ o
            h = self._rms(x, L["post_norm"])
            x = x + L["down"] @ (torch.nn.functional.silu(L["gate"] @ h) * (L["up"] @ h))
        return self.lm_head @ self._rms(x, self.norm)
