"""`transfer: shared` (and `auto`'s first question), agent side: the image-store probe. A token
written into this node's image store (`store_token`) that a peer reads back (`sees`) means both
see the same store."""

from __future__ import annotations

from pathlib import Path

from relocator.agent.modes.base import ModeBase


class SharedOps(ModeBase):
    def store_token(self) -> dict[str, str]:
        """Write a token file into this node's image store; a peer that reads it back sees the
        same store (shared storage)."""
        import uuid

        token = uuid.uuid4().hex
        path = self.images_dir / f".store-probe-{token}"
        path.write_text(token)
        return {"path": str(path), "token": token}

    def sees(self, path: str, token: str) -> bool:
        try:
            return Path(path).read_text() == token
        except OSError:
            return False

    def drop_token(self, path: str) -> None:
        p = Path(path)
        if p.name.startswith(".store-probe-"):
            p.unlink(missing_ok=True)
