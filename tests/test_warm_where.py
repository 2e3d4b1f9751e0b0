"""Whether a start of a worker's kind on a node would be warm (relocator.controller.warmwhere):
what `auto` picks a handoff on. Pure: fake agents, hosts and config."""

from __future__ import annotations

from relocator.controller.warmwhere import warm_start
from relocator.warm.config import WarmConfig

HOSTS = {"n1": "h1", "n2": "h1", "n3": "h2"}


def _where(holders: dict[str, set[str]], node: str = "n2", key: str | None = "k", cfg: WarmConfig | None = None,
           listing_fails: bool = False) -> dict:
    def keys(n: str) -> list[str]:
        if listing_fails:
            raise TimeoutError("agent of n2: warm_keys did not answer within 10s")
        return sorted(holders.get(n, set()))

    return warm_start(key, node, keys, holders, lambda: HOSTS, cfg or WarmConfig())


def test_the_target_is_asked_and_a_holder_on_its_host_is_near() -> None:
    here = _where({"n1": {"k"}, "n2": {"k"}, "n3": set()})
    assert here["warm"] == "here" and "n2 holds a warm image of its kind (k)" in here["why"], here
    near = _where({"n1": {"k"}, "n2": set(), "n3": set()})
    assert (near["warm"], near["from"]) == ("near", "n1"), near  # n1 shares n2's host: a local copy
    far = _where({"n1": set(), "n2": set(), "n3": {"k"}})  # another host: a copy over the network
    assert far["warm"] == "" and "no warm image of its kind (k) on n2 or its host" in far["why"], far


def test_never_warm_when_it_cannot_be_known() -> None:
    unknown = _where({"n2": {"k"}}, key=None)
    assert unknown["warm"] == "" and "its kind is not known" in unknown["why"], unknown
    off = _where({"n2": {"k"}}, cfg=WarmConfig(enabled=False))
    assert off["warm"] == "" and "warm images are off" in off["why"], off
    silent = _where({"n2": {"k"}}, listing_fails=True)
    assert silent["warm"] == "" and "n2 did not list its warm images (TimeoutError" in silent["why"], silent
    no_copy = _where({"n1": {"k"}, "n2": set()}, cfg=WarmConfig.model_validate({"prefetch": {"on_demand": False}}))
    assert no_copy["warm"] == "" and "on-demand copies are off" in no_copy["why"], no_copy
