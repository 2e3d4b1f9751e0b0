#!/usr/bin/env bash
# gpu-check: the product path for one GPU worker, as one JSON object on stdout.
#
# Reference engine (adapters/reference) in a real cell, on the GPU (--device cuda, the cell
# given GPU 0 through relocator.cell.devices) when the host has one, else on CPU; greedy
# streams; relocator.snapshot dump (cuda-checkpoint + CRIU) and restore into a new cell;
# the restored worker's streams must be token-identical to the source's; phase times and GB/s.
#
# Nothing is fetched at run time. Tools may be carried next to the repository (as
# ../shared/tools/gpu-probe did): GPU_CHECK_TOOLS=DIR puts DIR/bin first on PATH (a `criu`
# wrapper that sets LD_LIBRARY_PATH for criu alone, `ip`, `cuda-checkpoint`), and
# DIR/site (pip --target of missing wheels) on PYTHONPATH. The tiny model is generated locally.
#
# Usage: scripts/gpu-check.sh [--device auto|cuda|cpu] [--tokens N] [--out FILE]
# Exit status: 0 when the streams matched, 1 otherwise (the JSON says where it stopped).
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=auto TOKENS=32 OUTFILE=""
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    --tokens) TOKENS=$2; shift 2 ;;
    --out) OUTFILE=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ -n "${GPU_CHECK_TOOLS:-}" ]; then
  export PATH="$GPU_CHECK_TOOLS/bin:$PATH"
  [ -x "$GPU_CHECK_TOOLS/bin/cuda-checkpoint" ] && export RELOCATOR_CUDA_CHECKPOINT="$GPU_CHECK_TOOLS/bin/cuda-checkpoint"
  [ -d "$GPU_CHECK_TOOLS/site" ] && export PYTHONPATH="$GPU_CHECK_TOOLS/site${PYTHONPATH:+:$PYTHONPATH}"
fi
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export GPU_CHECK_DEVICE=$DEVICE GPU_CHECK_TOKENS=$TOKENS GPU_CHECK_OUT=$OUTFILE
exec "$PY" - <<'PYEOF'
import asyncio, json, os, shutil, sys, tempfile, time, traceback
from pathlib import Path

import aiohttp

R = {"device": None, "ok": False, "stage": "start", "phases": {}}
PROMPTS = ["the cluster node", "a worker moves to a new", "red river mountain light and"]
TOKENS = int(os.environ["GPU_CHECK_TOKENS"])


def emit(code):
    text = json.dumps(R, indent=2, default=str)
    if os.environ.get("GPU_CHECK_OUT"):
        Path(os.environ["GPU_CHECK_OUT"]).write_text(text)
    print(text, flush=True)
    sys.exit(code)


async def stream(endpoint, prompt):
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True}
    ids = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        async with s.post(f"{endpoint}/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                for choice in chunk.get("choices", []):
                    ids += choice.get("token_ids") or []
    return ids


async def streams(endpoint):
    return list(await asyncio.gather(*(stream(endpoint, p) for p in PROMPTS)))


def main():
    from relocator.cell import devices
    from relocator.snapshot import cuda, dump, restore
    from relocator.snapshot.criu import criu_binary, criu_version
    from relocator.tinymodel import ensure_tiny_model
    from relocator.worker import default_spec, launch_worker, wait_ready

    want = os.environ["GPU_CHECK_DEVICE"]
    gpus = devices.host_gpus()
    device = ("cuda" if gpus else "cpu") if want == "auto" else want
    R.update(device=device, host_gpus=[vars(g) for g in gpus], criu=criu_version(criu_binary()),
             cuda_checkpoint=cuda.binary(), cuda_checkpoint_active=cuda.available())
    if device == "cuda" and not gpus:
        raise RuntimeError("--device cuda but this host has no NVIDIA GPU node")
    R["stage"] = "model"
    model = ensure_tiny_model()
    spec = default_spec(model, engine="reference")
    spec.extra_args = ["--device", device]
    gpu_ids = [gpus[0].index] if device == "cuda" else None
    work = Path(tempfile.mkdtemp(prefix="gpu-check-", dir="/tmp"))
    cells = []
    try:
        R["stage"] = "launch"
        t = time.monotonic()
        src = launch_worker(spec, engine="reference", gpu_ids=gpu_ids)
        cells.append(src)
        R["cell_gpu_ids"] = src.gpu_ids
        R["phases"]["ready_s"] = round(asyncio.run(wait_ready(src, timeout=180)) + 0, 3)
        R["phases"]["launch_to_ready_s"] = round(time.monotonic() - t, 3)
        R["stage"] = "stream source"
        before = asyncio.run(streams(src.endpoint))
        R["tokens_per_stream"] = [len(x) for x in before]
        R["stage"] = "dump"
        img = dump(src, work / "image")
        R["phases"].update({k: round(v, 3) for k, v in img.manifest.timings.items()})
        R["image_bytes"] = img.bytes
        R["stage"] = "restore"
        t = time.monotonic()
        dst = restore(img)
        cells.append(dst)
        R["phases"]["restore_s"] = round(time.monotonic() - t, 3)
        rt = dst.dir / "restore_timings.json"
        if rt.exists():
            R["phases"]["restore_detail"] = json.loads(rt.read_text())
        R["phases"]["restore_ready_s"] = round(asyncio.run(wait_ready(dst, timeout=120, poll=0.05)), 3)
        R["stage"] = "stream restored"
        after = asyncio.run(streams(dst.endpoint))
        R["identical"] = after == before
        R["source_still_stopped"] = src.is_stopped()  # a woken source is a second live copy
        gb = img.bytes / 1e9
        p = R["phases"]
        if p.get("criu_dump_s"):
            R["dump_GBps"] = round(gb / (p["criu_dump_s"] + p.get("cuda_checkpoint_s", 0)), 3)
        if p.get("restore_s"):
            R["restore_GBps"] = round(gb / p["restore_s"], 3)
        R["ok"] = bool(R["identical"]) and R["source_still_stopped"]
        R["stage"] = "done"
    finally:
        for c in cells:
            try:
                R.setdefault("cell_logs", {})[c.id] = c.log_tail(15)
            except Exception:
                pass
            c.kill()
        shutil.rmtree(work, ignore_errors=True)


try:
    main()
except BaseException as exc:  # noqa: BLE001 - the JSON says where and why
    R["error"] = f"{type(exc).__name__}: {exc}"
    R["traceback"] = traceback.format_exc()[-3000:]
    emit(1)
R.pop("cell_logs", None)
emit(0 if R["ok"] else 1)
PYEOF
