"""Streaming load, token checks and abuse passes against the router (issue 6).

    from loadtests import LoadConfig, run_load, make_reference, check_tokens
    ref = await make_reference(LoadConfig(url=worker_url, model=m))   # direct, greedy only
    report = await run_load(LoadConfig(url=router_url, model=m, concurrency=8, requests=64))
    report.token_check = check_tokens(report, ref)
    report.write_png("timeline.png", phases=[("switch", t0, t1)])
"""

from .load import (
    LoadConfig,
    LoadReport,
    Reference,
    RequestResult,
    RequestSpec,
    TokenCheck,
    build_specs,
    check_tokens,
    load_reference,
    make_reference,
    run_load,
    save_reference,
)

__all__ = [
    "LoadConfig",
    "LoadReport",
    "Reference",
    "RequestResult",
    "RequestSpec",
    "TokenCheck",
    "build_specs",
    "check_tokens",
    "load_reference",
    "make_reference",
    "run_load",
    "save_reference",
]
