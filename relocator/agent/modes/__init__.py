"""The node agent's side of the transfer modes, one module per mode (the controller's side:
relocator.controller.transfers). NodeAgent inherits `ModeOps`, so each mode's ops are agent
calls of their own name.

- shared (and auto): the image-store probe, `store_token` here, `sees` on the peer;
- stream: `open_page_server` on the target, `dump(page_server=)` on the source, then
  `receive_image` on the target completes the image;
- postcopy: `transfer_info` (what this node's kernel and CRIU allow), `dump_lazy` on the source,
  the small files streamed, `restore(page_source=)` on the target, `postcopy_wait` there,
  `lazy_dump_wait` on the source.
"""

from __future__ import annotations

from relocator.agent.modes.base import ModeBase, transfer_address
from relocator.agent.modes.postcopy import PostcopyOps
from relocator.agent.modes.shared import SharedOps
from relocator.agent.modes.stream import StreamOps


class ModeOps(SharedOps, StreamOps, PostcopyOps):  # one base per mode
    """Every mode's agent ops (NodeAgent inherits them)."""


__all__ = ["ModeBase", "ModeOps", "PostcopyOps", "SharedOps", "StreamOps", "transfer_address"]
