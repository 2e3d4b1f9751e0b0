"""Tokenizers by model, for the text of continued streams (loaded once, off the hot path)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class TokenizerRegistry:
    """Tokenizers by model, loaded once from a path (a model directory holding tokenizer.json,
    or the file itself). A model without one is continued with the engine's own text."""

    paths: dict[str, str] = field(default_factory=dict)
    _loaded: dict[str, Any] = field(default_factory=dict)
    _failed: dict[str, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @staticmethod
    def resolve(path: str | Path) -> Path:
        p = Path(path)
        return p / "tokenizer.json" if p.is_dir() else p

    @classmethod
    def check_path(cls, path: str | Path) -> str | None:
        """Why `path` cannot serve as a tokenizer (None: it can)."""
        f = cls.resolve(path)
        if not f.is_file():
            return f"no tokenizer.json at {path}"
        return None

    def register(self, model: str, path: str | Path) -> None:
        path = str(path)
        with self._lock:
            if self.paths.get(model) != path:
                self.paths[model] = path
                self._loaded.pop(model, None)
                self._failed.pop(model, None)

    def load(self, model: str) -> Any | None:
        """The model's tokenizer (loading it the first time), or None."""
        with self._lock:
            if model in self._loaded:
                return self._loaded[model]
            path = self.paths.get(model)
            if path is None or model in self._failed:
                return None
            try:
                from tokenizers import Tokenizer

                tok = Tokenizer.from_file(str(self.resolve(path)))
            except Exception as e:  # a broken file must not break streaming
                self._failed[model] = str(e)
                log.error("tokenizer of %s at %s unusable (%s): continued streams carry the "
                          "engine's text", model, path, e)
                return None
            self._loaded[model] = tok
            return tok

    def distrust(self, model: str, why: str) -> None:
        """Stop using a tokenizer that disagrees with the engine."""
        with self._lock:
            self._loaded.pop(model, None)
            self._failed[model] = why
        log.error("tokenizer of %s disagrees with the engine (%s): continued streams carry the "
                  "engine's text", model, why)
