"""Control-API client, async (`RouterControl`) and sync (`RouterControlSync`).

    async with RouterControl("http://127.0.0.1:8001", token=...) as rc:
        await rc.hold("w1"); ...; await rc.switch("w1", "http://10.251.0.2:8000")
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


class ControlError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        msg = body.get("error", {}).get("message") if isinstance(body, dict) else body
        super().__init__(f"{status}: {msg}")
        self.status = status
        self.body = body


def _add_body(worker_id: str, model: str, url: str, tokenizer: str | None,
              engine: str | None, gpus: float | None = None) -> dict:
    body: dict[str, Any] = {"worker_id": worker_id, "model": model, "url": url}
    if gpus is not None:
        body["gpus"] = gpus  # whole GPUs or a share of one (shown in the table)
    if tokenizer:
        body["tokenizer"] = tokenizer  # the model's tokenizer, for text-exact continuation
    if engine:
        body["engine"] = engine  # the replica's engine (default: the router's `engine`)
    return body


def _paths(worker: str | None = None) -> dict[str, str]:
    from urllib.parse import quote

    w = quote(worker or "", safe="")
    return {"replicas": "/control/replicas", "replica": f"/control/replicas/{w}",
            "hold": f"/control/workers/{w}/hold", "switch": f"/control/workers/{w}/switch",
            "release": f"/control/workers/{w}/release", "streams": f"/control/workers/{w}/streams",
            "reach": f"/control/workers/{w}/reach"}


class RouterControl:
    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self._session = None

    async def __aenter__(self) -> "RouterControl":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        async with self._session.request(method, self.base_url + path, json=body,
                                         headers=headers) as r:
            data = await r.json(content_type=None)
            if r.status >= 400:
                raise ControlError(r.status, data)
            return data

    async def replicas(self) -> dict:
        return await self._call("GET", _paths()["replicas"])

    async def add_replica(self, worker_id: str, model: str, url: str,
                          tokenizer: str | None = None, engine: str | None = None,
                          gpus: float | None = None) -> dict:
        return await self._call("POST", _paths()["replicas"],
                                _add_body(worker_id, model, url, tokenizer, engine, gpus))

    async def remove_replica(self, worker_id: str) -> dict:
        return await self._call("DELETE", _paths(worker_id)["replica"])

    async def hold(self, worker_id: str) -> dict:
        return await self._call("POST", _paths(worker_id)["hold"])

    async def switch(self, worker_id: str, endpoint: str, release: bool = True,
                     keep_inexact: bool = False, catch_up_rounds: int = 0, at_token: bool = False) -> dict:
        body: dict[str, Any] = {"endpoint": endpoint, "release": release}
        if keep_inexact:
            body["keep_inexact"] = True
        if at_token:
            body["at_token"] = True
        if catch_up_rounds:
            body["catch_up_rounds"] = catch_up_rounds
        return await self._call("POST", _paths(worker_id)["switch"], body)

    async def streams(self, worker_id: str) -> list[dict]:
        return (await self._call("GET", _paths(worker_id)["streams"]))["streams"]

    async def reach(self, worker_id: str, timeout_s: float = 2.0) -> dict:
        return await self._call("GET", f"{_paths(worker_id)['reach']}?timeout_s={timeout_s:g}")

    async def release(self, worker_id: str) -> dict:
        return await self._call("POST", _paths(worker_id)["release"])


class RouterControlSync:
    """Same calls, blocking, stdlib only (usable from a Ray actor without an event loop)."""

    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                payload = json.loads(raw)
            except ValueError:
                payload = raw.decode(errors="replace")
            raise ControlError(e.code, payload) from None

    def replicas(self) -> dict:
        return self._call("GET", _paths()["replicas"])

    def add_replica(self, worker_id: str, model: str, url: str,
                    tokenizer: str | None = None, engine: str | None = None, gpus: float | None = None) -> dict:
        return self._call("POST", _paths()["replicas"],
                          _add_body(worker_id, model, url, tokenizer, engine, gpus))

    def remove_replica(self, worker_id: str) -> dict:
        return self._call("DELETE", _paths(worker_id)["replica"])

    def hold(self, worker_id: str) -> dict:
        return self._call("POST", _paths(worker_id)["hold"])

    def switch(self, worker_id: str, endpoint: str, release: bool = True, keep_inexact: bool = False,
               cut_from: str | None = None, catch_up_rounds: int = 0, at_token: bool = False) -> dict:
        """`catch_up_rounds`: the router first prefills `endpoint` with the streams (a handoff's
        last warm-up, relocator.router.catchup), at most that many rounds. `at_token`: each
        stream is cut right after its next token (the source serves on: a handoff)."""
        body: dict[str, Any] = {"endpoint": endpoint, "release": release}
        if keep_inexact:
            body["keep_inexact"] = True
        if at_token:
            body["at_token"] = True
        if cut_from:
            body["cut_from"] = cut_from
        if catch_up_rounds:
            body["catch_up_rounds"] = catch_up_rounds
        return self._call("POST", _paths(worker_id)["switch"], body)

    def streams(self, worker_id: str) -> list[dict]:
        """The worker's streams in flight (prompt_ids, sent_ids, inexact)."""
        return self._call("GET", _paths(worker_id)["streams"])["streams"]

    def reach(self, worker_id: str, timeout_s: float = 2.0) -> dict:
        """Whether the router reaches the worker's endpoint now ({reachable, endpoint, seconds})."""
        return self._call("GET", f"{_paths(worker_id)['reach']}?timeout_s={timeout_s:g}")

    def release(self, worker_id: str) -> dict:
        return self._call("POST", _paths(worker_id)["release"])
