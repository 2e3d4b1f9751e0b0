"""Small helpers shared by the end-to-end tests on the session cluster."""

from __future__ import annotations

import time


def clean(rep: dict) -> None:
    """A load report with traffic, no client error, every token and text as the reference's."""
    assert rep["requests"] > 0
    assert rep["client_errors"] == 0, rep["errors"]
    assert (rep["tokens_lost"], rep["tokens_duplicated"], rep["tokens_mismatched"]) == (0, 0, 0), rep
    assert rep["text_mismatched"] == 0, rep["text_bad"]


def workers(ctl) -> dict[str, dict]:
    return {w["id"]: w for w in ctl.status()["workers"]}


def wait_for(pred, timeout: float = 120.0, what: str = "", poll: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(poll)
    raise TimeoutError(what)
