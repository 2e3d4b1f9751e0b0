"""The reference engine's device extras, for scripts/gpu-check.sh: a KV pool and a CUDA graph.

- The KV pool (`--kv-pool-mb N`): N MiB reserved on the device up front and every byte of it
  written, as vLLM's pool is (the reference engine's requests keep their own caches, so the pool
  is all free). `release` drops it (on CUDA: and empties torch's cache, so the driver holds
  none of it and cuda-checkpoint has nothing of it to copy), `reserve` takes it again: released
  before a dump and reserved after the restore, the free pool is left out of the image (what
  NVIDIA Dynamo Snapshot does before a capture).
- The CUDA graph (`--cuda-graph`, CUDA only): one graph captured at start (the LM head over a
  static hidden state); `check` replays it and compares with the eager result, so a restored
  copy proves its captured graph still runs and computes the same."""

from __future__ import annotations

import torch


class DeviceExtras:
    def __init__(self, device: torch.device, lm_head: torch.Tensor, pool_mb: int = 0,
                 graph: bool = False) -> None:
        self.device = device
        self.pool_mb = pool_mb
        self.pool: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.reserve()
        if graph:
            if device.type != "cuda":
                raise ValueError("--cuda-graph needs --device cuda")
            self._capture(lm_head)

    def reserve(self) -> int:
        """Take the pool (every page written); its size in bytes."""
        if self.pool_mb and self.pool is None:
            self.pool = torch.ones(self.pool_mb << 18, dtype=torch.float32, device=self.device)
        return self.pool_bytes()

    def release(self) -> int:
        """Drop the pool; the bytes it held."""
        held = self.pool_bytes()
        self.pool = None
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return held

    def pool_bytes(self) -> int:
        return 0 if self.pool is None else self.pool.numel() * self.pool.element_size()

    def _capture(self, lm_head: torch.Tensor) -> None:
        self.w = lm_head
        self.x = torch.randn(lm_head.shape[1], device=self.device, generator=torch.Generator(
            device=self.device).manual_seed(0))
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            self.y = self.w @ self.x  # warm-up on a side stream, as torch's docs capture
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.y = self.w @ self.x

    def check(self) -> dict:
        """Replay the graph; whether it matches eager (None: no graph)."""
        out: dict = {"pool_bytes": self.pool_bytes(), "graph": None, "device_bytes": None}
        if self.device.type == "cuda":
            out["device_bytes"] = torch.cuda.memory_reserved(self.device)
        if self.graph is not None:
            self.graph.replay()
            torch.cuda.synchronize()
            out["graph"] = bool(torch.allclose(self.y, self.w @ self.x))
        return out
