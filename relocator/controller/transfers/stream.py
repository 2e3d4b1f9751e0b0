"""`transfer: stream`: agent to agent. The target's page server receives the memory while CRIU
dumps it (hashed as it arrives); TRANSFER brings the small images and completes the image there."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relocator.controller.transfers.base import Context, TransferStrategy
from relocator.vocab import TransferMode

if TYPE_CHECKING:
    from relocator.controller.model import Relocation


class StreamCalls:
    """The stream mode's agent calls (RayBackend inherits them; relocator.agent.modes.stream)."""

    def open_page_server(self, node: str, image_dir: str) -> dict:
        return self.agents.call(node, lambda a: a.open_page_server.remote(image_dir),  # type: ignore[attr-defined]
                                "open_page_server", timeout=60)


class StreamTransfer(TransferStrategy):
    mode = TransferMode.STREAM
    auto_rank = 2
    verified_on_arrival = True
    calls = StreamCalls

    def dump(self, ctx: Context, rel: "Relocation") -> dict:
        # the target's page server first: the memory goes there while CRIU reads it
        ps = ctx.backend.open_page_server(rel.dst, rel.dst_image_dir)
        info = ctx.backend.dump(rel.src, rel.src_cell, rel.image_dir, page_server=ps)
        rel.image_bytes = int(info.get("bytes", 0))  # the small images; TRANSFER adds the pages
        return info

    def transfer(self, ctx: Context, rel: "Relocation") -> dict:
        # the images besides the memory the page server already has (completed and stamped there)
        info = ctx.backend.transfer(rel.src, rel.dst, rel.image_dir, rel.dst_image_dir)
        rel.image_bytes = int(info.get("bytes", rel.image_bytes))
        ctx.save(rel)
        return info
