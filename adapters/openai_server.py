"""What every engine with an OpenAI-compatible HTTP server shares: the readiness probe and
reading its Prometheus page. Apart from adapters.base so that the router's light imports
(codecs, the registry) never pull in an HTTP client."""

from __future__ import annotations

import json

import aiohttp
from prometheus_client.parser import text_string_to_metric_families


async def is_ready(base_url: str, timeout: float = 2.0) -> bool:
    """True once GET /health answers 200 and GET /v1/models lists a model (engines answer 503
    on /health while starting)."""
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    try:
        async with aiohttp.ClientSession(timeout=client_timeout) as session:
            async with session.get(f"{base_url}/health") as resp:
                if resp.status != 200:
                    return False
            async with session.get(f"{base_url}/v1/models") as resp:
                return resp.status == 200 and bool((await resp.json()).get("data"))
    except (aiohttp.ClientError, TimeoutError, OSError, json.JSONDecodeError):
        return False


def parse_metrics(text: str, prefix: str) -> dict[str, float]:
    """The samples of the metric families named `prefix*`, summed over labels."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(prefix):
            continue
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out
