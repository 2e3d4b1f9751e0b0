"""API keys of the router's OpenAI API (`Authorization: Bearer <key>`, as OpenAI's own API).

The router accepts any of its keys (`api_keys`, `api_key_file`: one a line, and the
RELOCATOR_API_KEY environment variable); our own clients (the CLI's demo/load/bench, the
cluster's streams, the load tests) send RELOCATOR_API_KEY when it is set. Keys are compared in
constant time. A router bound beyond loopback without a key must be told so (`insecure`)."""

from __future__ import annotations

import hmac
import ipaddress
import os
from pathlib import Path
from typing import Iterable

from .errors import RouterError

ENV_KEY = "RELOCATOR_API_KEY"
LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str | None) -> bool:
    """True for an address only this machine reaches (127.0.0.0/8, ::1, localhost); an
    unspecified one (0.0.0.0, ::, "") binds every interface and is not."""
    if not host:
        return False
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname: it may resolve to anything


def read_key_file(path: str | Path) -> list[str]:
    """The keys of a file: one a line, blank lines and `#` comments skipped."""
    lines = Path(path).read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def env_keys() -> list[str]:
    """RELOCATOR_API_KEY, if set (comma-separated for several)."""
    return [k.strip() for k in os.environ.get(ENV_KEY, "").split(",") if k.strip()]


def key_matches(header: str | None, keys: Iterable[bytes]) -> bool:
    """Whether `Authorization: Bearer <key>` names one of `keys`. Every key is compared, each
    in constant time, so the time taken says nothing of how much of a key was right."""
    got = (header or "").encode()
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(got, b"Bearer " + key)
    return ok


def invalid_api_key(missing: bool) -> RouterError:
    """OpenAI's 401: `invalid_request_error` / `invalid_api_key`."""
    msg = ("You didn't provide an API key. Provide it in an Authorization header using Bearer "
           "auth (i.e. Authorization: Bearer YOUR_KEY)." if missing
           else "Incorrect API key provided.")
    return RouterError(401, msg, type="invalid_request_error", code="invalid_api_key")


def client_headers(key: str | None = None) -> dict[str, str]:
    """The header our own clients send the router: `key`, else RELOCATOR_API_KEY's first key;
    none when neither is set (a router on loopback needs none)."""
    key = key or next(iter(env_keys()), None)
    return {"Authorization": f"Bearer {key}"} if key else {}
