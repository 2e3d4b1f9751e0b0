"""`transfer: stream`, agent side: the target's page server (relocator.agent.pagestream) that
receives a dump's memory while the source's `dump(page_server=)` runs; `receive_image` then
completes the image."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relocator.agent.modes.base import ModeBase, transfer_address


class StreamOps(ModeBase):
    def open_page_server(self, image_dir: str, peer_address: str = "") -> dict[str, Any]:
        """`transfer: stream`: a page server receiving a dump's memory into `image_dir` (this
        node's), hashed as it arrives; receive_image completes the image. `peer_address`: the
        source's transfer address (its dump connects from there; "": any address)."""
        from relocator.agent.pagestream import PageReceiver

        old = self._receivers.pop(str(image_dir), None)
        if old is not None:
            old.abort()
        rx = PageReceiver(Path(image_dir), transfer_address(), peer_address).start()
        self._receivers[str(image_dir)] = rx
        return {**rx.offer(), "image_dir": str(image_dir)}
