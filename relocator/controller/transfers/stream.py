"""`transfer: stream`: agent to agent. The target's page server receives the memory while CRIU
dumps it (hashed as it arrives); TRANSFER brings the small images and completes the image there."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relocator.controller.transfers.base import Context, TransferStrategy
from relocator.controller.transfers.peers import address_kw, forget
from relocator.vocab import TransferMode

if TYPE_CHECKING:
    from relocator.controller.model import Relocation, WorkerRecord


class StreamCalls:
    """The stream mode's agent calls (RayBackend inherits them; relocator.agent.modes.stream)."""

    def open_page_server(self, node: str, image_dir: str, peer_address: str = "") -> dict:
        """`peer_address`: the source's transfer address, the only one the target's front lets
        compete for its handshake slots (relocator.controller.transfers.peers)."""
        return self.agents.call(node, lambda a: a.open_page_server.remote(image_dir, peer_address),  # type: ignore[attr-defined]
                                "open_page_server", timeout=60)


class StreamTransfer(TransferStrategy):
    mode = TransferMode.STREAM
    auto_rank = 2
    verified_on_arrival = True
    calls = StreamCalls

    def dump(self, ctx: Context, rel: "Relocation") -> dict:
        # the target's page server first: the memory goes there while CRIU reads it
        ps = ctx.backend.open_page_server(rel.dst, rel.dst_image_dir, **address_kw(ctx.backend, rel.src))
        info = ctx.backend.dump(rel.src, rel.src_cell, rel.image_dir, page_server=ps)
        rel.image_bytes = int(info.get("bytes", 0))  # the small images; TRANSFER adds the pages
        return info

    def transfer(self, ctx: Context, rel: "Relocation") -> dict:
        # the images besides the memory the page server already has (completed and stamped there)
        info = ctx.backend.transfer(rel.src, rel.dst, rel.image_dir, rel.dst_image_dir)
        rel.image_bytes = int(info.get("bytes", rel.image_bytes))
        ctx.save(rel)
        return info

    def rollback(self, rel: "Relocation", worker: "WorkerRecord") -> None:
        forget(rel.src)  # a source that changed address would be refused by the front again
