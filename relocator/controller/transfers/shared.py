"""`transfer: shared`: every node sees the image directory, so there is nothing to copy."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from relocator.controller.transfers.base import Context, TransferStrategy
from relocator.vocab import TransferMode

if TYPE_CHECKING:
    from relocator.controller.model import Relocation, WorkerRecord


class SharedCalls:
    """The agent calls of the image-store probe (RayBackend inherits them; relocator.agent.modes.shared)."""

    def shared_storage(self, src: str, dst: str) -> bool:
        """Whether `dst` sees `src`'s image store (a token written by one, read by the other)."""
        agents = self.agents  # type: ignore[attr-defined]
        probe = agents.call(src, lambda a: a.store_token.remote(), "store_token", timeout=30)
        try:
            return bool(agents.call(dst, lambda a: a.sees.remote(probe["path"], probe["token"]), "sees", timeout=30))
        finally:
            try:
                agents.call(src, lambda a: a.drop_token.remote(probe["path"]), "drop_token", timeout=30)
            except Exception:  # noqa: BLE001 - a leftover probe file is harmless
                pass


class SharedTransfer(TransferStrategy):
    mode = TransferMode.SHARED
    auto_rank = 0
    keeps_image = True
    calls = SharedCalls

    def available(self, backend: Any, worker: "WorkerRecord", dst: str) -> tuple[bool, str]:
        if backend.shared_storage(worker.node, dst):
            return True, f"{dst} sees {worker.node}'s image store"
        return False, "no shared image store"

    def target_image(self, backend: Any, rel: "Relocation", worker: "WorkerRecord") -> tuple[str, str, str]:
        return rel.image_dir, "disk", ""  # the source's image store

    def transfer(self, ctx: Context, rel: "Relocation") -> dict:
        return {"skipped": "shared storage"}
