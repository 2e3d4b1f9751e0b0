"""`python -m relocator.router`: the router process with nothing but what it needs (no CLI
framework), for a supervisor that restarts it (the local cluster daemon). Same options as
`relocator router serve`."""

from __future__ import annotations

import argparse

from relocator.choices import LogLevel

from .policies import RouterPolicy


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m relocator.router", description=__doc__)
    ap.add_argument("--config", "-c", help="YAML file (key `router:` or top level); "
                    "RELOCATOR_ROUTER_* env overrides it")
    ap.add_argument("--host", help="API listen address")
    ap.add_argument("--port", type=int, help="API port")
    ap.add_argument("--fd", type=int, dest="listen_fd",
                    help="serve the API on this inherited listening socket (overrides host/port)")
    ap.add_argument("--state-file", help="persist the routing table here and load it at start")
    ap.add_argument("--backend", "-b", action="append", default=[],
                    help="MODEL=URL or WORKER@MODEL=URL, repeatable")
    ap.add_argument("--policy", choices=RouterPolicy.values(), help="replica selection policy")
    ap.add_argument("--log-level", default=LogLevel.WARNING.value, choices=LogLevel.values(),
                    type=str.lower, help="Python log level")
    a = ap.parse_args(argv)
    from .config import RouterSettings, parse_backend
    from .server import run

    settings = RouterSettings.load(a.config, host=a.host, port=a.port, policy=a.policy,
                                   listen_fd=a.listen_fd, state_file=a.state_file)
    if a.backend:
        settings.backends = settings.backends + [parse_backend(b) for b in a.backend]
    run(settings, a.log_level)


if __name__ == "__main__":
    main()
