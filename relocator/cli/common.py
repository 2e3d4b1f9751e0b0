"""What every CLI command shares: consoles, JSON output, and turning errors into messages."""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Any, Callable, Iterable, TextIO, TypeVar

import typer
from rich.console import Console

console = Console()
err = Console(stderr=True)
F = TypeVar("F", bound=Callable[..., Any])


def print_json(obj: Any, file: TextIO | None = None) -> None:
    out = file or sys.stdout
    out.write(json.dumps(obj, indent=2, default=str) + "\n")
    out.flush()


def stdout_for_json() -> TextIO:
    """The real stdout, kept for the one JSON document a `--json` command prints; from now on
    anything else printed to sys.stdout goes to stderr. Ray's driver prints raylet errors
    there ("(raylet) Raylet is terminated ...") from a thread that log_to_driver=False does not
    stop and that outlives the run, hence no switch back."""
    real = sys.stdout
    _kept.append(real)  # a stream no longer sys.stdout must not be collected (closed) before use
    sys.stdout = sys.stderr
    return real


_kept: list[TextIO] = []


def fail(message: str, code: int = 1) -> None:
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)  # one line, for logs
    raise typer.Exit(code)


def handle_errors(fn: F) -> F:
    """Known failures become one clear line and a non-zero exit, not a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
        except Exception as exc:  # noqa: BLE001 - the CLI boundary
            if os.environ.get("RELOCATOR_DEBUG"):
                raise
            fail(f"{exc}  ({type(exc).__name__}; set RELOCATOR_DEBUG=1 for a traceback)", 2)

    return wrapper  # type: ignore[return-value]


def choice_list(parse: Callable[[str], Any], choices: Callable[[], Iterable[str]],
                words: Callable[[], Iterable[str]] = tuple) -> Callable[[Any], Any]:
    """A typer callback for a comma list of names from a fixed set (`--policy fgd,best-fit`):
    `parse` (ValueError naming the valid names on a wrong one) runs while the options are
    read, so a wrong name is a usage error (exit 2), before any work starts. `choices` (the
    valid names) and `words` (other names `parse` accepts: aliases, "all") stay lazy, so the
    module that owns them is imported only by the command that uses them; tests read both."""

    def callback(value: Any) -> Any:
        if value is not None:
            try:
                parse(value)
            except ValueError as exc:
                raise typer.BadParameter(str(exc)) from None
        return value

    callback.choices = lambda: tuple(choices())  # type: ignore[attr-defined]
    callback.words = lambda: tuple(words())  # type: ignore[attr-defined]
    return callback
