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


def test_the_ray_backend_asks_the_controllers_port_and_auto_takes_a_handoff_on_it() -> None:
    from pathlib import Path

    from relocator.controller import transfers
    from relocator.controller.backend import BackendPorts, RayBackend
    from relocator.controller.model import WorkerRecord

    asked: list[tuple[str, str]] = []

    def warm_image(worker_id: str, node: str) -> dict:
        asked.append((worker_id, node))
        return {"warm": "here", "why": f"{node} holds a warm image of its kind (k)"}

    be = RayBackend(BackendPorts(inventory=lambda refresh=False: {}, node_dir=lambda n: Path("/b/nodes") / n,
                                 place=None, router=None, worker=None, setting={}.get, warm_image=warm_image))
    w = WorkerRecord(id="w1", model="m", node="n1", gpus=1, cell_id="c1", model_dir="/models/m")
    chosen, why = transfers.choose(be, w, "n2", "auto")  # handoff is tried first: no other probe runs
    assert chosen.mode == "handoff" and asked == [("w1", "n2")], (chosen.mode, why, asked)
    assert why == "handoff (make-before-break): n2 holds a warm image of its kind (k); " \
                  "the second copy starts while the source serves"
    # a controller without the port (BackendPorts' default): nothing is warm, a freezing mode is chosen
    assert BackendPorts(None, None, None, None, None, None).warm_image("w1", "n2") == {}  # type: ignore[arg-type]
