"""scripts/gpu-check.sh's driver: one worker moved through the product's parts on one machine.

The reference engine (adapters/reference; on CUDA with a captured CUDA graph and a KV pool) in a
cell, the router (`python -m relocator.router`, a subprocess on loopback) in front of it, and
three moves under STREAMS greedy streams sent through the router, each compared token by token
with an unmoved run of the same prompts:
  1. freeze and copy: HOLD, snapshot.dump (cuda-checkpoint + CRIU; the source left stopped),
     snapshot.restore into a new cell on the same device, SWITCH (the router continues every
     stream there), RELEASE (the source killed); the source is checked stopped (psutil's state,
     and cuda-checkpoint's "checkpointed" on CUDA) after DUMP, after RESTORE and before RELEASE;
  2. the same from that copy with its free KV pool released before DUMP (reserved again after
     RESTORE), so the image leaves it out;
  then a warm capture of that copy as the agent takes one (the engine asleep around
  cuda-checkpoint on a GPU: relocator/warm/sleep.py) and a copy restored from it, woken, both
  answering the first prompt exactly (GPU_CHECK_WARM=0 leaves it out);
  3. a handoff (make before break) from that copy to the warm copy, two cells on the one device,
     as relocator/controller/transfers/handoff.py runs it: the source's threads favoured (nice
     -10), the controller's warm-up rounds (`warm_up`: the router's streams in flight prefilled on
     the target through the agent's prefill op), SWITCH with the router's catch-up and the cut at
     a token boundary, RELEASE once no stream reads from the source; the source is never frozen
     (checked running before and after SWITCH). Without a warm copy the target starts cold.
No Ray and no controller: the phases are run in order here with the parts the controller's
machine calls (relocator.snapshot, relocator.warm, relocator.worker, the router's control API,
the handoff's warm-up and release checks with a local stand-in for its Ray calls). One JSON
object on stdout (`run` returns it)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from relocator import waits
from relocator.ports import free_port
from relocator.router.client import RouterControl
from relocator.warm import sleep

PROMPTS = ["the cluster node", "a worker moves to a new", "red river mountain light and",
           "seven blue", "one more prompt for the", "tokens keep coming", "hold then switch", "x"]
MODEL = "tiny-llama"
WORKER = "w1"


async def stream(base: str, prompt: str, tokens: int, gaps: list[float]) -> list[int]:
    """One greedy stream's token ids; appends its largest gap between chunks to `gaps`."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True}
    ids: list[int] = []
    last, worst = time.monotonic(), 0.0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        async with s.post(f"{base}/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                for choice in chunk.get("choices", []):
                    ids += choice.get("token_ids") or []
                now = time.monotonic()
                worst, last = max(worst, now - last), now
    gaps.append(worst)
    return ids


def compare(base: list[list[int]], got: list[list[int] | BaseException]) -> dict[str, int]:
    """Tokens lost, duplicated and mismatched against the unmoved run; failed streams."""
    out = {"tokens_lost": 0, "tokens_dup": 0, "tokens_mismatched": 0, "client_errors": 0}
    for b, g in zip(base, got):
        if isinstance(g, BaseException):
            out["client_errors"] += 1
            out["tokens_lost"] += len(b)
            continue
        out["tokens_mismatched"] += sum(1 for x, y in zip(b, g) if x != y)
        out["tokens_lost"] += max(0, len(b) - len(g))
        out["tokens_dup"] += max(0, len(g) - len(b))
    return out


class Check:
    """The run's state: device, spec, router, cells, figures."""

    def __init__(self, device: str, tokens: int, pool_mb: int, work: Path) -> None:
        from relocator.cell import devices
        from relocator.tinymodel import ensure_tiny_model
        from relocator.worker import default_spec

        self.device, self.tokens, self.pool_mb, self.work = device, tokens, pool_mb, work
        gpus = devices.host_gpus()
        if device == "cuda" and not gpus:
            raise RuntimeError("--device cuda but this host has no NVIDIA GPU node")
        self.gpu_ids = [gpus[0].index] if device == "cuda" else None
        self.model = ensure_tiny_model()
        self.spec = default_spec(self.model, engine="reference")
        self.spec.extra_args = ["--device", device, "--kv-pool-mb", str(pool_mb)]
        if device == "cuda":
            self.spec.extra_args.append("--cuda-graph")
        if os.environ.get("PYTHONPATH"):  # a bundle's wheels (gpu-check.sh --bundle): the cell's
            self.spec.env["PYTHONPATH"] = os.environ["PYTHONPATH"]  # default is the repository alone
        from adapters.base import get_adapter
        from relocator.worker import spec_to_dict

        #: the reference engine's (sleep, wake): its pool released and reserved
        self.pool_calls = get_adapter("reference").sleep_calls(spec_to_dict(self.spec))
        #: a warm capture of the serving copy (asleep on CUDA), then a copy restored from it, the
        #: handoff's target: GPU_CHECK_WARM=1|0, default on (0: the handoff's target starts cold)
        self.warm = os.environ.get("GPU_CHECK_WARM", "1") == "1"
        self.cells: list[Any] = []
        self.router: subprocess.Popen | None = None
        self.R: dict[str, Any] = {"device": device, "host_gpus": [vars(g) for g in gpus],
                                  "streams": len(PROMPTS), "tokens_per_stream": tokens,
                                  "kv_pool_mb": pool_mb, "moves": {}}

    # -- parts ---------------------------------------------------------------------------
    def launch(self) -> Any:
        from relocator.worker import launch_worker

        cell = launch_worker(self.spec, engine="reference", gpu_ids=self.gpu_ids)
        self.cells.append(cell)
        return cell

    async def ready(self, cell: Any, timeout: float = 180) -> float:
        from relocator.worker import wait_ready

        return round(await wait_ready(cell, timeout=timeout, poll=0.05), 3)

    async def device_call(self, cell: Any, action: str) -> dict:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async with s.post(f"{cell.endpoint}/device/{action}") as r:
                r.raise_for_status()
                return await r.json()

    def start_router(self) -> tuple[str, str]:
        port, cport = free_port(), free_port()
        env = {**os.environ, "RELOCATOR_ROUTER_CONTROL_PORT": str(cport)}
        log = open(self.work / "router.log", "wb")
        self.router = subprocess.Popen([sys.executable, "-m", "relocator.router", "--host", "127.0.0.1",
                                        "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
        base, control = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{cport}"

        def up() -> bool:
            if self.router.poll() is not None:
                raise RuntimeError(f"the router exited: {(self.work / 'router.log').read_text()[-2000:]}")
            return _port_open(port)

        waits.until(up, 30, every=0.1, what="the router")
        return base, control

    def source_stopped(self, cell: Any) -> bool:
        """psutil says every process of the cell is stopped; on CUDA, cuda-checkpoint says every
        process that had a context is still checkpointed."""
        if not cell.is_stopped():
            return False
        if self.device != "cuda":
            return True
        from relocator.snapshot import cuda

        states = cuda.contexts(cell.pids())
        return bool(states) and all(s == cuda.CudaState.CHECKPOINTED for s in states.values())

    # -- the streams ---------------------------------------------------------------------
    def start_streams(self, base: str, gaps: list[float]) -> asyncio.Future:
        return asyncio.gather(*(stream(base, p, self.tokens, gaps) for p in PROMPTS),
                              return_exceptions=True)

    async def in_flight(self, rc: RouterControl, at_least: int = 4) -> int:
        """Wait until every stream has sent `at_least` tokens; the number in flight."""
        async def enough() -> bool:
            s = await rc.streams(WORKER)
            return len(s) == len(PROMPTS) and all(len(x["sent_ids"]) >= at_least for x in s)

        try:
            await waits.until_async(enough, 60, every=0.02, what="the streams in flight")
        except waits.WaitTimeout:
            pass
        return len(await rc.streams(WORKER))


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


async def freeze_and_copy(ck: Check, rc: RouterControl, base: str, src: Any, drop_pool: bool) -> tuple[dict, Any]:
    """One freeze-and-copy move of the worker's replica from `src`; (figures, the new cell)."""
    from relocator.snapshot import dump, restore

    gaps: list[float] = []
    m: dict[str, Any] = {"kv_pool_in_image": not drop_pool}
    run = ck.start_streams(base, gaps)
    m["streams_in_flight_at_hold"] = await ck.in_flight(rc)
    t_hold = time.monotonic()
    await rc.hold(WORKER)
    if drop_pool:  # the call a warm capture makes (relocator/warm/sleep.py)
        m["pool_released_bytes"] = (await asyncio.to_thread(sleep.call, src.endpoint, ck.pool_calls[0]))["bytes"]
    img = await asyncio.to_thread(dump, src, ck.work / f"image-{len(ck.cells)}")
    m["dump_s"] = round(time.monotonic() - t_hold, 3)
    m["dump_timings"] = {k: round(v, 3) for k, v in img.manifest.timings.items()}
    m["image_bytes"] = img.bytes
    stopped = [ck.source_stopped(src)]
    t = time.monotonic()
    dst = await asyncio.to_thread(restore, img)
    ck.cells.append(dst)
    m["restore_s"] = round(time.monotonic() - t, 3)
    m["restore_ready_s"] = await ck.ready(dst, 120)
    if drop_pool:
        m["pool_reserved_bytes"] = (await asyncio.to_thread(sleep.call, dst.endpoint, ck.pool_calls[1]))["bytes"]
    m["device_check"] = await ck.device_call(dst, "check")
    stopped.append(ck.source_stopped(src))
    m["switch"] = {k: v for k, v in (await rc.switch(WORKER, dst.endpoint)).items() if k != "streams"}
    m["blackout_s"] = round(time.monotonic() - t_hold, 3)
    stopped.append(ck.source_stopped(src))
    m["source_stayed_stopped"] = all(stopped)
    src.kill()  # RELEASE
    m["result"] = await run
    m["max_token_gap_s"] = round(max(gaps, default=0.0), 3)
    shutil.rmtree(img.path, ignore_errors=True)
    if ck.device == "cuda":
        _cuda_rates(m)
    return m, dst


async def warm_capture(ck: Check, src: Any, base_ids: list[int]) -> tuple[dict[str, Any], Any]:
    """A warm image of the serving worker taken as the agent takes one (relocator/warm/capture.py:
    on a GPU the engine asleep around cuda-checkpoint, so its pool is not in the image), then a
    copy restored from it as a warm start does (woken before use). Both must answer the first
    prompt exactly as the unmoved run did. (figures, the copy): the copy is the handoff's target."""
    from relocator.snapshot.manifest import read_manifest
    from relocator.warm.capture import capture
    from relocator.warm.start import restore_warm
    from relocator.warm.store import ImageStore

    store = ImageStore(ck.work / "warm-store", 1 << 40)
    t = time.monotonic()
    entry, _ = await asyncio.to_thread(capture, src, store)
    timings = read_manifest(entry.path).timings
    m: dict[str, Any] = {"capture_s": round(time.monotonic() - t, 3), "image_bytes": entry.bytes,
                         "asleep": sleep.ASLEEP in timings,
                         "timings": {k: round(v, 3) for k, v in timings.items()}}
    m["source_exact_after"] = await stream(src.endpoint, PROMPTS[0], ck.tokens, []) == base_ids
    t = time.monotonic()
    copy = await asyncio.to_thread(restore_warm, store, entry.key)
    ck.cells.append(copy)
    m["restore_s"] = round(time.monotonic() - t, 3)  # the wake included
    m["restore_ready_s"] = await ck.ready(copy, 120)
    m["device_check"] = await ck.device_call(copy, "check")
    m["copy_exact"] = await stream(copy.endpoint, PROMPTS[0], ck.tokens, []) == base_ids
    m["ok"] = m["source_exact_after"] and m["copy_exact"] and m["asleep"] == (ck.device == "cuda")
    return m, copy


def _cuda_rates(m: dict) -> None:
    dev = (m.get("device_check") or {}).get("device_bytes") or 0
    cs = m["dump_timings"].get("cuda_checkpoint_s")
    m["cuda_checkpoint_GBps"] = round(dev / 1e9 / cs, 3) if cs else None
    m["cuda_restore_GBps"] = round(dev / 1e9 / m["restore_s"], 3) if m["restore_s"] else None  # criu + cuda


class LocalCalls:
    """The handoff's calls that the controller makes through Ray (HandoffCalls: prioritize,
    router_streams, prefill), made here in this process: the agent's ops on this machine's cells
    and the router's control API. `warm_up`, `favour` and `on_source` run on it unchanged."""

    def __init__(self, control: str, cells: dict[str, Any]) -> None:
        from relocator.agent.modes.handoff import HandoffOps
        from relocator.router.client import RouterControlSync

        self.rc, self.ops, self.cells = RouterControlSync(control), HandoffOps(), cells

    def prioritize(self, node: str, cell_id: str, nice: int | None) -> int:
        """As the agent's (HandoffOps.prioritize), on this process's cells: None is normal again."""
        from relocator.warm.lowstart import set_priority

        return set_priority(self.cells[cell_id], nice)

    def router_streams(self, worker_id: str) -> list[dict]:
        return self.rc.streams(worker_id)

    def prefill(self, node: str, endpoint: str, model: str, sequences: list[list[int]]) -> dict:
        return self.ops.prefill(endpoint, model, sequences)


def warmup_plan(prefix_cache: bool) -> dict[str, Any]:
    """The controller's warm-up rounds and the router's catch-up rounds for a handoff to a copy
    whose engine keeps a prefix cache or not. Without one (the reference engine) a prefill is a whole
    recompute, one token a step as the source decodes one, so each round's sequences are about
    twice the last and the source always runs ahead (measured on CPU: 3 rounds in 0.61 s, the 8
    streams of 64 tokens over before SWITCH, 0 moved): one round, which runs the warm-up's calls,
    and no catch-up."""
    from relocator.controller.transfers.handoff import CATCH_UP_ROUNDS, MAX_ROUNDS

    if prefix_cache:
        return {"rounds": MAX_ROUNDS, "catch_up_rounds": CATCH_UP_ROUNDS, "why": "as the controller"}
    return {"rounds": 1, "catch_up_rounds": 0,
            "why": "no prefix cache: a prefill recomputes, the source runs ahead of every round"}


async def start_cold(ck: Check, why: str) -> tuple[Any, dict[str, Any]]:
    """The handoff's target without a warm image: a cold launch, as the agent's launch then does."""
    t = time.monotonic()
    dst = ck.launch()
    ready = await ck.ready(dst)
    return dst, {"warm": False, "start_why": why, "target_ready_s": ready, "start_s": round(time.monotonic() - t, 3)}


async def handoff(ck: Check, rc: RouterControl, control: str, base: str, src: Any,
                  dst: Any, start: dict[str, Any]) -> tuple[dict, Any]:
    """Make before break from `src` to `dst`, a second copy already serving on the same device
    (`start`: how it started), as HandoffTransfer's RESTORE (after the start), SWITCH and RELEASE
    run: the source's threads favoured, the controller's warm-up rounds under the streams, the
    router's switch (its catch-up where `warmup_plan` has one) and the cut after a token,
    RELEASE once no stream reads from the source. The streams begin once the target serves: the tiny model's streams are
    shorter than a start, and those in flight at SWITCH are what the move proves."""
    from relocator.controller.transfers.handoff import SOURCE_NICE, WINDOW_S, favour, on_source, warm_up
    from types import SimpleNamespace

    calls = LocalCalls(control, {src.id: src})
    rel = SimpleNamespace(id="gpu-check", worker=WORKER, src="local", src_cell=src.id, src_endpoint=src.endpoint,
                          dst="local", dst_endpoint=dst.endpoint)
    plan = warmup_plan(prefix_cache=False)  # the reference engine keeps none
    m: dict[str, Any] = {"transfer": "handoff", **start, "warmup_plan": plan}
    favour(calls, rel, SOURCE_NICE)
    gaps: list[float] = []
    running = [not src.is_stopped()]
    run = ck.start_streams(base, gaps)
    m["streams_in_flight_at_warmup"] = await ck.in_flight(rc)
    m["warmup"] = await asyncio.to_thread(warm_up, calls, rel, SimpleNamespace(id=WORKER, model=MODEL), plan["rounds"])
    running.append(not src.is_stopped())
    t = time.monotonic()
    m["switch"] = {k: v for k, v in (await rc.switch(WORKER, dst.endpoint, keep_inexact=True, at_token=True,
                                                    catch_up_rounds=plan["catch_up_rounds"])).items() if k != "streams"}
    m["blackout_s"] = round(time.monotonic() - t, 3)
    running.append(not src.is_stopped())
    t = time.monotonic()  # RELEASE: greedy streams are exact, none is kept on the source
    m["left_on_source"] = 0 if await asyncio.to_thread(
        waits.settle, lambda: on_source(calls, rel) == 0, WINDOW_S, 0.1) else on_source(calls, rel)
    m["release_wait_s"] = round(time.monotonic() - t, 3)
    m["source_frozen_s"] = 0.0
    m["source_never_stopped"] = all(running)
    m["result"] = await run
    src.kill()
    m["max_token_gap_s"] = round(max(gaps, default=0.0), 3)
    return m, dst


async def moves(ck: Check) -> None:
    R = ck.R
    src = ck.launch()
    R["ready_s"] = await ck.ready(src)
    R["device_check"] = await ck.device_call(src, "check")
    gaps: list[float] = []
    t = time.monotonic()
    base_tokens = await asyncio.gather(*(stream(src.endpoint, p, ck.tokens, gaps) for p in PROMPTS))
    R["step_s"] = {"unmoved": round(time.monotonic() - t, 3)}
    R["stage"] = "router"
    base, control = ck.start_router()
    async with RouterControl(control) as rc:
        await rc.add_replica(WORKER, MODEL, src.endpoint, tokenizer=str(ck.model), engine="reference")
        for name, drop in (("pool_in_image", False), ("pool_left_out", True)):
            R["stage"], t = name, time.monotonic()
            m, src = await freeze_and_copy(ck, rc, base, src, drop)
            m.update(compare(base_tokens, m.pop("result")))
            R["moves"][name], R["step_s"][name] = m, round(time.monotonic() - t, 3)
        dst, start = None, {}
        if ck.warm:
            R["stage"], t = "warm_capture", time.monotonic()
            try:
                R["warm_capture"], dst = await warm_capture(ck, src, base_tokens[0])
                start = {"warm": True, "start_why": "the warm image of the warm capture",
                         "start_s": R["warm_capture"]["restore_s"]}
            except Exception as exc:  # noqa: BLE001 - as a launch does: the handoff starts cold
                R["warm_capture"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            R["step_s"]["warm_capture"] = round(time.monotonic() - t, 3)
        R["stage"], t = "handoff", time.monotonic()
        if dst is None:
            dst, start = await start_cold(ck, R.get("warm_capture", {}).get("error") or "GPU_CHECK_WARM=0")
        m, src = await handoff(ck, rc, control, base, src, dst, start)
        m.update(compare(base_tokens, m.pop("result")))
        R["moves"]["handoff"], R["step_s"]["handoff"] = m, round(time.monotonic() - t, 3)


def handoff_ok(m: dict[str, Any], warm_asked: bool) -> bool:
    """The handoff was make-before-break and exact: every stream identical to the unmoved run,
    none left on the source, the source never stopped, and the target started warm when a warm
    capture was asked for (its moved streams are reported, not required: with the tiny model's
    short streams, how many are still in flight at SWITCH is a matter of speed)."""
    return (bool(m) and not any(m.get(k, 1) for k in ("tokens_lost", "tokens_dup", "tokens_mismatched", "client_errors"))
            and m.get("left_on_source") == 0 and m.get("source_frozen_s") == 0.0
            and m.get("source_never_stopped") is True and (m.get("warm") is True or not warm_asked))


def summary(R: dict) -> None:
    """The headline figures of the run, from its moves."""
    mv = R["moves"]
    a, b = mv.get("pool_in_image", {}), mv.get("pool_left_out", {})
    R.update({"dump_s": a.get("dump_s"), "restore_s": a.get("restore_s"),
              "cuda_checkpoint_GBps": a.get("cuda_checkpoint_GBps"),
              "cuda_restore_GBps": a.get("cuda_restore_GBps"),
              "image_bytes": a.get("image_bytes"), "image_bytes_no_kv_pool": b.get("image_bytes"),
              "blackout_s": a.get("blackout_s"), "blackout_s_no_kv_pool": b.get("blackout_s"),
              "handoff_blackout_s": mv.get("handoff", {}).get("blackout_s")})
    h = mv.get("handoff", {})
    R.update({"handoff_ok": handoff_ok(h, bool(R.get("warm_capture_asked"))), "handoff_warm": h.get("warm"),
              "handoff_start_s": h.get("start_s"), "handoff_moved_streams": (h.get("switch") or {}).get("moved_streams"),
              "handoff_source_frozen_s": h.get("source_frozen_s"), "handoff_max_token_gap_s": h.get("max_token_gap_s")})
    for k in ("tokens_lost", "tokens_dup", "tokens_mismatched", "client_errors"):
        R[k] = sum(m.get(k, 0) for m in mv.values())
    R["source_stayed_stopped"] = all(m.get("source_stayed_stopped", True) for m in mv.values()) and bool(mv)
    graph = [m.get("device_check", {}).get("graph") for m in mv.values() if "device_check" in m]
    R["cuda_graph_ok"] = None if R["device"] != "cuda" else bool(graph) and all(graph)
    warm = R.get("warm_capture")
    R["warm_image_bytes_asleep"] = warm.get("image_bytes") if warm and warm.get("asleep") else None
    R["ok"] = (len(mv) == 3 and R["source_stayed_stopped"] and R["cuda_graph_ok"] is not False and R["handoff_ok"]
               and not any(R[k] for k in ("tokens_lost", "tokens_dup", "tokens_mismatched", "client_errors"))
               and (not R.get("warm_capture_asked") or bool(warm and warm.get("ok"))))


def run(device: str = "auto", tokens: int = 64, pool_mb: int = 256) -> dict:
    from relocator.cell import devices
    from relocator.snapshot import cuda
    from relocator.snapshot.criu import criu_binary, criu_version

    from relocator.credentials import use_machine_key

    use_machine_key()  # a by-hand run: images signed with this machine's key (as `relocator snapshot`)
    if device == "auto":
        device = "cuda" if devices.host_gpus() else "cpu"
    work = Path(tempfile.mkdtemp(prefix="gpu-check-", dir=os.environ.get("GPU_CHECK_WORK", "/dev/shm")))
    ck = Check(device, tokens, pool_mb, work)
    R = ck.R
    R.update(ok=False, stage="start", criu=criu_version(criu_binary()), cuda_checkpoint=cuda.binary(),
             cuda_checkpoint_active=cuda.available(), warm_capture_asked=ck.warm)
    t0 = time.monotonic()
    try:
        asyncio.run(moves(ck))
        R["stage"] = "done"
    except BaseException as exc:  # noqa: BLE001 - the JSON says where and why
        R["error"] = f"{type(exc).__name__}: {exc}"
        R["cell_logs"] = {c.id: _tail(c) for c in ck.cells}
        R["router_log"] = _read(work / "router.log")[-2000:]
    finally:
        for c in ck.cells:
            c.kill()
        if ck.router is not None:
            ck.router.terminate()
            ck.router.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    R["wall_s"] = round(time.monotonic() - t0, 3)
    summary(R)
    return R


def _tail(cell: Any) -> str:
    try:
        return cell.log_tail(15)
    except Exception as e:  # noqa: BLE001 - a log is best effort
        return f"(no log: {e})"


def _read(p: Path) -> str:
    return p.read_text(errors="replace") if p.exists() else ""


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m relocator.bench.gpucheck")
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--kv-pool-mb", type=int, default=256)
    a = ap.parse_args()
    out = run(a.device, a.tokens, a.kv_pool_mb)
    print(json.dumps(out, indent=2, default=str), flush=True)
    sys.exit(0 if out["ok"] else 1)
