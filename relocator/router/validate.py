"""A request body as the router reads it before any engine sees it: a JSON object naming a
model the table serves, with the fields the router uses itself of the right type; anything
else is a 4xx `RouterError` (OpenAI-shaped), never a crash."""

from __future__ import annotations

import json

from . import errors
from .stream import lax_bool
from .table import RoutingTable


def parse_body(raw: bytes, table: RoutingTable) -> dict:
    """A request body as a JSON object naming a model the table serves, or a 4xx RouterError."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        # RecursionError: JSON nested deeper than the parser's stack (an abuse case).
        raise errors.bad_request(f"Malformed JSON body: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise errors.bad_request("The request body must be a JSON object.",
                                 code="invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise errors.bad_request("Missing required parameter: 'model'.",
                                 code="missing_model", param="model")
    if not table.has_model(model):
        raise errors.model_not_found(model)
    check_types(body)
    if "stream" in body:
        # vLLM's pydantic reads "true", "on", 1 as true (lax mode): read as the router's own
        # non-stream, such a request would come back from the engine as SSE on the unary path
        body["stream"] = lax_bool(body["stream"])
    return body


def check_required(kind: str, body: dict) -> None:
    """A 400 for a request without what its kind needs (messages, prompt)."""
    if kind == "chat" and not isinstance(body.get("messages"), list):
        raise errors.bad_request("Missing required parameter: 'messages'.",
                                 code="missing_required_parameter", param="messages")
    if kind == "completions" and "prompt" not in body:
        raise errors.bad_request("Missing required parameter: 'prompt'.",
                                 code="missing_required_parameter", param="prompt")


#: fields the router itself uses before an engine has validated them (stream state, the
#: translated first request's text making and budget): the wrong type would crash it. The
#: rest is the engine's to validate.
_INT_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens")


def check_types(body: dict) -> None:
    """A 400 for a field of the wrong type that the router reads itself."""
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise errors.bad_request(f"'stream_options' must be an object, not "
                                 f"{_json_type(so)}.", code="invalid_type",
                                 param="stream_options")
    for k in _INT_FIELDS:
        v = body.get(k)
        if v is None or (isinstance(v, int) and not isinstance(v, bool)):
            continue
        if isinstance(v, float) and v.is_integer():
            continue  # 5.0 is 5, as the engine reads it (inf and NaN are not integers)
        raise errors.bad_request(f"'{k}' must be an integer, not {_json_type(v)}.",
                                 code="invalid_type", param=k)


def _json_type(v: object) -> str:
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return f"the number {v!r}"
    return {dict: "an object", list: "an array", str: "a string"}.get(type(v), type(v).__name__)
