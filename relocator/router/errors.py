"""OpenAI-shaped errors. Transport-agnostic: every front end turns a RouterError into
`status` + `json_body()`; streams that already started get `sse_event()` instead."""

from __future__ import annotations

import json
from typing import Any


class RouterError(Exception):
    """An error the client sees, in OpenAI's shape:
    {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def json_body(self) -> bytes:
        return json.dumps(self.body()).encode()

    def sse_event(self) -> bytes:
        """The error as one SSE event followed by the end marker (for a stream that has
        already sent bytes: it cannot change its status code any more)."""
        return b"data: " + self.json_body() + b"\n\ndata: [DONE]\n\n"

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"RouterError({self.status}, {self.message!r}, code={self.code!r})"


def bad_request(message: str, code: str = "bad_request", param: str | None = None) -> RouterError:
    return RouterError(400, message, code=code, param=param)


def model_not_found(model: str) -> RouterError:
    return RouterError(404, f"The model `{model}` does not exist.", type="invalid_request_error",
                       code="model_not_found", param="model")


def body_too_large(limit: int) -> RouterError:
    return RouterError(413, f"Request body larger than {limit} bytes.", code="request_too_large")


def upstream_unavailable(message: str) -> RouterError:
    return RouterError(502, message, type="upstream_error", code="upstream_unavailable")


def hold_timeout(worker: str, timeout: float) -> RouterError:
    return RouterError(503, f"Worker {worker} is being relocated and did not come back within "
                            f"{timeout:g}s; retry later.", type="service_unavailable",
                       code="hold_timeout")


def hold_queue_full(worker: str) -> RouterError:
    return RouterError(503, f"Worker {worker} is being relocated and its hold queue is full; "
                            "retry later.", type="service_unavailable", code="hold_queue_full")


def worker_unreachable(worker: str, seconds: float) -> RouterError:
    return RouterError(503, f"Worker {worker} unreachable for {seconds:g} s; retry later.",
                       type="service_unavailable", code="worker_unreachable")


def no_replica(model: str) -> RouterError:
    return RouterError(503, f"No replica of `{model}` is available.", type="service_unavailable",
                       code="no_replica")


def continuation_failed(message: str) -> RouterError:
    return RouterError(502, message, type="upstream_error", code="continuation_failed")


def unauthorized() -> RouterError:
    return RouterError(401, "Invalid or missing control API token.", type="authentication_error",
                       code="invalid_token")
