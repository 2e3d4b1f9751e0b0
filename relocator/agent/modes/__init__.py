"""The node agent's side of the transfer modes, one module per mode (the controller's side:
relocator.controller.transfers). NodeAgent inherits `ModeOps`, so each mode's ops are agent
calls of their own name. Every module here is imported and its ops class (a ModeBase) joins
`ModeOps` by itself: a new mode is one module.

- shared (and auto): the image-store probe, `store_token` here, `sees` on the peer;
- stream: `open_page_server` on the target, `dump(page_server=)` on the source, then
  `receive_image` on the target completes the image;
- postcopy: `transfer_info` (what this node's kernel and CRIU allow), `dump_lazy` on the source,
  the small files streamed, `restore(page_source=)` on the target, `postcopy_wait` there,
  `lazy_dump_wait` on the source.
"""

from __future__ import annotations

import importlib
import pkgutil

from relocator.agent.modes.base import OPS, ModeBase, transfer_address

for _m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    importlib.import_module(f"{__name__}.{_m.name}")  # each registers its ops class (OPS)

from relocator.agent.modes.postcopy import PostcopyOps  # noqa: E402 - registered above
from relocator.agent.modes.shared import SharedOps  # noqa: E402
from relocator.agent.modes.stream import StreamOps  # noqa: E402

#: every mode's agent ops (NodeAgent inherits them): one base per module of this package
ModeOps: type = type("ModeOps", tuple(OPS), {"__doc__": "Every mode's agent ops (NodeAgent inherits them)."})

__all__ = ["ModeBase", "ModeOps", "PostcopyOps", "SharedOps", "StreamOps", "transfer_address"]
