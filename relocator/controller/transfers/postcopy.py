"""`transfer: postcopy`: the worker restarts on the target before its memory has arrived; pages
come from the frozen source on demand and in the background (relocator.agent.postcopy, pump).
The source stays frozen and resumable until every page has arrived: RELEASE waits for that, and
a post-copy that fails after the switch rolls back to the source."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from relocator.controller.errors import NodeLost, PlanError, PostCopyFailed, TargetLost
from relocator.controller.transfers.base import Context, TransferStrategy
from relocator.controller.transfers.peers import address_kw, forget
from relocator.vocab import TransferMode
from relocator.waits import WaitTimeout, settle, until

if TYPE_CHECKING:
    from relocator.controller.model import Relocation, WorkerRecord

#: how long RELEASE waits for the source's lazy dump to end once the target has every page
SOURCE_END_S = 30.0


#: why `auto` never picks post-copy when either node has NVIDIA GPUs (docs/gpu.md)
GPU_NO_GAIN = ("cuda restore reads all checkpointed device memory inside RESTORE, so every lazy page "
               "is faulted in during the blackout and post-copy gains nothing over stream")


def gpu_nodes(src_info: dict, dst_info: dict) -> list[str]:
    """Which of the two nodes (agents' transfer_info) have real NVIDIA GPUs."""
    return [f"{side} has {int(info.get('nvidia_gpus') or 0)} NVIDIA GPU(s)"
            for side, info in (("source", src_info), ("target", dst_info)) if int(info.get("nvidia_gpus") or 0) > 0]


def postcopy_problems(src_info: dict, dst_info: dict) -> list[str]:
    """Why a post-copy from the node of `src_info` to that of `dst_info` (agents'
    transfer_info) cannot run; empty: it can."""
    out = []
    if not dst_info.get("uffd_noncoop", [False])[0]:
        out.append(f"target: no non-cooperative userfaultfd ({dst_info.get('uffd_noncoop', ['', '?'])[1]})")
    if not src_info.get("lazy_dump_pipes", [False])[0]:
        out.append(f"source: {src_info.get('lazy_dump_pipes', ['', '?'])[1]}")
    return out


class PostcopyCalls:
    """The post-copy's agent calls (RayBackend inherits them; relocator.agent.modes.postcopy)."""

    def transfer_info(self, node: str) -> dict:
        return self.agents.call(node, lambda a: a.transfer_info.remote(), "transfer_info",  # type: ignore[attr-defined]
                                timeout=60)

    def dump_lazy(self, node: str, cell_id: str, image_dir: str, peer_address: str = "") -> dict:
        """`peer_address`: the target's transfer address (its keeper's connections alone compete
        for the source front's handshake slots)."""
        return self.agents.call(node, lambda a: a.dump_lazy.remote(cell_id, image_dir, peer_address),  # type: ignore[attr-defined]
                                "dump_lazy")

    def postcopy_status(self, node: str, cell_id: str) -> dict:
        return self.agents.call(node, lambda a: a.postcopy_status.remote(cell_id), "postcopy_status",  # type: ignore[attr-defined]
                                timeout=30)

    def postcopy_wait(self, node: str, cell_id: str, timeout: float = 1.0) -> dict:
        """The target's post-copy, once ended or after `timeout`; a lost target node counts as
        the copy being gone."""
        try:
            return self.agents.call(node, lambda a: a.postcopy_wait.remote(cell_id, timeout),  # type: ignore[attr-defined]
                                    "postcopy_wait", timeout=timeout + 30)
        except NodeLost:
            return {"state": "failed", "why": "target", "error": f"target node {node} lost"}

    def lazy_dump_wait(self, node: str, cell_id: str, timeout: float = 1.0) -> dict:
        try:
            return self.agents.call(node, lambda a: a.lazy_dump_wait.remote(cell_id, timeout),  # type: ignore[attr-defined]
                                    "lazy_dump_wait", timeout=timeout + 30)
        except NodeLost:
            return {"done": True, "lost": True}


def _local_route(info: dict) -> dict:
    """The pump's unix socket and the source's host identity, when the lazy dump offers them: a
    keeper on the source's host takes that socket instead of TLS (relocator.agent.locallink)."""
    return {k: info[k] for k in ("pump_unix", "host")} if info.get("pump_unix") else {}


class PostcopyTransfer(TransferStrategy):
    mode = TransferMode.POSTCOPY
    auto_rank = 1
    verified_on_arrival = True
    calls = PostcopyCalls

    def __init__(self) -> None:
        # each move's credential for its keeper (the source's make_move), by relocation: in
        # memory only, never in the record (stored, and shown by the API); gone with the move
        self._credentials: dict[str, dict] = {}

    # -- PLAN ---------------------------------------------------------------------------------
    def problems(self, backend: Any, worker: "WorkerRecord", dst: str) -> list[str]:
        return postcopy_problems(backend.transfer_info(worker.node), backend.transfer_info(dst))

    def available(self, backend: Any, worker: "WorkerRecord", dst: str) -> tuple[bool, str]:
        src_info, dst_info = backend.transfer_info(worker.node), backend.transfer_info(dst)
        gpus = gpu_nodes(src_info, dst_info)
        if gpus:  # the rule for GPU nodes: an explicit `transfer: postcopy` still runs
            return False, f"no post-copy on GPU nodes ({', '.join(gpus)}): {GPU_NO_GAIN}"
        problems = postcopy_problems(src_info, dst_info)
        if problems:
            return False, "no post-copy: " + "; ".join(problems)
        return True, "both kernels support post-copy"

    def check(self, backend: Any, worker: "WorkerRecord", dst: str) -> None:
        problems = self.problems(backend, worker, dst)
        if problems:
            raise PlanError("transfer postcopy is not possible: " + "; ".join(problems))

    # -- DUMP / TRANSFER / RESTORE ------------------------------------------------------------
    def dump(self, ctx: Context, rel: "Relocation") -> dict:
        info = ctx.backend.dump_lazy(rel.src, rel.src_cell, rel.image_dir, **address_kw(ctx.backend, rel.dst))
        credential = info.pop("credential", None)
        if credential:
            self._credentials[rel.id] = credential
        rel.image_bytes = int(info.get("bytes", 0)) + int(info.get("lazy_bytes", 0))
        rel.postcopy = {"address": info["address"], "port": info["port"],
                        "pump_port": int(info.get("pump_port") or 0), "lazy_bytes": int(info.get("lazy_bytes", 0)),
                        **_local_route(info)}
        return info

    # TRANSFER: every image but the memory left in the source (the default transfer)

    def restore(self, ctx: Context, rel: "Relocation") -> dict:
        source = {"address": rel.postcopy["address"], "port": rel.postcopy["port"],
                  "pump_port": rel.postcopy.get("pump_port", 0), **_local_route(rel.postcopy),
                  **dict(rel.faults.get("postcopy") or {})}
        if rel.id in self._credentials:  # absent after a controller restart: the front refuses the keeper
            source["credential"] = self._credentials[rel.id]
        return ctx.backend.restore(rel.dst, rel.dst_image_dir, rel.dst_cell, verified=True,
                                   gpu_ids=rel.dst_gpu_ids or None, page_source=source)

    # -- SWITCH -------------------------------------------------------------------------------
    def on_switch(self, ctx: Context, rel: "Relocation", worker: "WorkerRecord") -> None:
        if "src_gpu_ids" not in rel.postcopy:
            # a post-copy can still roll back after the switch: remember what the source had
            rel.postcopy["src_gpu_ids"] = list(worker.gpu_ids)
            ctx.save(rel)

    def after_switch(self, ctx: Context, rel: "Relocation", switched_at: float) -> dict[str, Any]:
        if "bytes_at_switch" in rel.postcopy:
            return {}
        try:
            st = ctx.backend.postcopy_status(rel.dst, rel.dst_cell)
        except Exception as exc:  # noqa: BLE001 - a figure only; RELEASE checks the post-copy
            st = {"error": str(exc)}
        rel.postcopy.update(bytes_at_switch=int(st.get("page_bytes", 0) or 0), switched_at=switched_at)
        ctx.save(rel)
        return {"postcopy_bytes_at_switch": rel.postcopy["bytes_at_switch"]}

    # -- RELEASE ------------------------------------------------------------------------------
    def release(self, ctx: Context, rel: "Relocation") -> dict[str, Any]:
        """The source stays frozen and resumable until every page has arrived on the target
        (the target's keeper says done, the source's lazy dump ends)."""
        self._credentials.pop(rel.id, None)  # the keeper has used it (it connected at RESTORE)
        st = self._wait_target(ctx, rel)
        page_bytes = int(st.get("page_bytes", 0) or 0)
        started, ended = st.get("started_at"), st.get("ended_at")
        switched = rel.postcopy.get("switched_at")
        rel.postcopy.update(
            page_bytes=page_bytes,
            pushed_bytes=int(st.get("pushed_bytes", 0) or 0),  # of them, by the source's push (relocator.agent.pump)
            pages_after_switch_bytes=max(0, page_bytes - int(rel.postcopy.get("bytes_at_switch", 0))),
            postcopy_s=round(ended - started, 3) if started and ended else None,
            after_switch_s=round(ended - switched, 3) if ended and switched else None)
        ctx.save(rel)
        src_done = self._wait_source(ctx, rel)
        try:
            ctx.target_alive(rel, "after the post-copy")
        except TargetLost as exc:
            # the copy died as its last pages came (the keeper's daemon ends as for a copy that has
            # them all): the frozen source is still whole until RELEASE ends: back to it (CI's
            # chaos smoke: a kill during the post-copy came out `done`, the worker then lost)
            rel.postcopy.update(failed="target", error=str(exc))
            ctx.save(rel)
            raise PostCopyFailed(f"post-copy failed (target): {exc}", "target") from None
        return {"postcopy_s": rel.postcopy.get("postcopy_s"), "page_bytes": page_bytes,
                "pushed_bytes": rel.postcopy["pushed_bytes"],
                "pages_after_switch_bytes": rel.postcopy["pages_after_switch_bytes"],
                "source_dump": src_done}

    @staticmethod
    def _wait_target(ctx: Context, rel: "Relocation") -> dict:
        def ended() -> dict | None:
            st = ctx.backend.postcopy_wait(rel.dst, rel.dst_cell, timeout=1.0)  # blocks up to 1 s
            state = st.get("state")
            if state in ("failed", "absent"):
                why = st.get("why") or ("target" if state == "absent" else "daemon")
                rel.postcopy.update(failed=why, error=st.get("error", ""), page_bytes=int(st.get("page_bytes", 0) or 0))
                ctx.save(rel)
                raise PostCopyFailed(f"post-copy failed ({why}): {st.get('error') or state}", why)
            return st if state == "done" else None

        try:
            return until(ended, ctx.postcopy_timeout_s, every=0.0, what="the post-copy")
        except WaitTimeout:
            raise PostCopyFailed(f"post-copy not done after {ctx.postcopy_timeout_s:.0f}s", "stall") from None

    @staticmethod
    def _wait_source(ctx: Context, rel: "Relocation") -> dict:
        """The source's page server ends once the target closed its session: then the tree is
        stopped again and can go (a source node lost at this point no longer matters)."""
        last: dict = {}

        def ended() -> bool:
            nonlocal last
            try:
                last = ctx.backend.lazy_dump_wait(rel.src, rel.src_cell, timeout=1.0)
            except Exception as exc:  # noqa: BLE001 - stop asking; RELEASE goes on
                last = {"done": False, "error": str(exc)}
                return True
            return bool(last.get("done"))

        settle(ended, SOURCE_END_S, every=0.0)
        return last

    def rollback(self, rel: "Relocation", worker: "WorkerRecord") -> None:
        self._credentials.pop(rel.id, None)
        forget(rel.dst)  # a target that changed address would be refused by the front again
        if "src_gpu_ids" in rel.postcopy:  # rolled back after its switch
            worker.gpu_ids = list(rel.postcopy["src_gpu_ids"])


__all__ = ["PostcopyCalls", "PostcopyTransfer", "postcopy_problems"]
