"""The router's own small requests to an engine (not the client's): the prompt ids it renders
for a request (a stream sent as a continuation from its first token) and the text of ids (to
check the router's tokenizer against the engine's detokenizer once per model)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Awaitable, Callable

from adapters.codec import ContinuationCodec

from .stream import StreamState
from .table import Replica
from .tokenizers import TokenizerRegistry
from .transport import UpstreamResponse

log = logging.getLogger("relocator.router.core")

#: async (url, body) -> response: the core's upstream
Post = Callable[[str, bytes], Awaitable[UpstreamResponse]]


class EngineCalls:
    def __init__(self, post: Post, tokenizers: TokenizerRegistry) -> None:
        self.post = post
        self.tokenizers = tokenizers
        self._checked: set[str] = set()  # models whose tokenizer decodes as the engine does
        self._checking: dict[str, asyncio.Future] = {}  # models whose check is under way

    async def prompt_ids(self, r: Replica, codec: ContinuationCodec,
                         st: StreamState) -> list[int] | None:
        """The prompt ids `r`'s engine renders for the request; None when it refuses (the
        request then goes to the engine as it is, which answers with its own error)."""
        path, req = codec.prompt_ids_request(st.kind, st.body) or (None, None)
        if path is None:
            return None
        resp = await self.post(r.endpoint + path, json.dumps(req).encode())  # UpstreamError: retried
        try:
            if resp.status != 200:
                return None
            data = await resp.read()
        finally:
            resp.close()
        try:
            return codec.parse_prompt_ids(json.loads(data))
        except ValueError as e:
            log.warning("prompt ids from %s unusable (%s): request sent as it is", r.worker_id, e)
            return None

    async def tokenizer(self, r: Replica, codec: ContinuationCodec, model: str,
                        sample: list[int]) -> Any | None:
        """The model's tokenizer for continued text, checked once against the engine's own
        detokenizer on `sample` (a tokenizer that decodes otherwise is not used); None: the
        continuation carries the engine's text."""
        tok = self.tokenizers.load(model)
        if tok is None or model in self._checked or not sample:
            return tok
        pending = self._checking.get(model)
        if pending is not None:  # another stream's check is under way (8 splices at once): its verdict
            await asyncio.shield(pending)
            return self.tokenizers.load(model)
        self._checking[model] = done = asyncio.get_running_loop().create_future()
        try:
            return await self._check(r, codec, model, sample, tok)
        finally:
            del self._checking[model]
            done.set_result(None)

    async def _check(self, r: Replica, codec: ContinuationCodec, model: str, sample: list[int],
                     tok: Any) -> Any | None:
        engine_text = await self.detokenize(r, codec, model, sample)
        if engine_text is None:
            return tok  # the engine cannot say; trust the configured tokenizer
        ours = tok.decode(sample, skip_special_tokens=False)
        if ours != engine_text:
            self.tokenizers.distrust(model, f"{len(sample)} ids decode to {ours[:40]!r}... here, "
                                            f"{engine_text[:40]!r}... on {r.worker_id}")
            return None
        self._checked.add(model)
        return tok

    async def detokenize(self, r: Replica, codec: ContinuationCodec, model: str,
                         ids: list[int]) -> str | None:
        """The text of `ids` from `r`'s detokenizer; None if unsupported or it failed."""
        req = codec.detokenize_request(model, ids)
        if req is None or not ids:
            return None
        try:
            resp = await self.post(r.endpoint + req[0], json.dumps(req[1]).encode())
            try:
                if resp.status != 200:
                    return None
                return codec.parse_detokenize(json.loads(await resp.read()))
            finally:
                resp.close()
        except Exception as e:  # pragma: no cover - best effort
            log.warning("detokenize failed on %s: %s", r.worker_id, e)
            return None
