"""Persistence for the controller: one sqlite file (WAL), rows of JSON per kind.

A relocation is written *before* each of its phases starts, so a controller that restarts
reads where every open relocation stood and completes or rolls it back.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any, Iterator

from relocator.controller.model import RUNNING, Demand, Relocation, WorkerRecord


class Store:
    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("CREATE TABLE IF NOT EXISTS docs (kind TEXT, id TEXT, body TEXT, "
                         "PRIMARY KEY (kind, id))")
        # events: append-only, numbered (the number is a subscriber's cursor)
        self._db.execute("CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY AUTOINCREMENT, body TEXT)")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- generic ---------------------------------------------------------------------------
    def put(self, kind: str, key: str, body: dict[str, Any]) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO docs VALUES (?, ?, ?)", (kind, key, json.dumps(body)))

    def get(self, kind: str, key: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute("SELECT body FROM docs WHERE kind=? AND id=?", (kind, key)).fetchone()
        return json.loads(row[0]) if row else None

    def all(self, kind: str) -> Iterator[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT body FROM docs WHERE kind=? ORDER BY rowid", (kind,)).fetchall()
        for (body,) in rows:
            yield json.loads(body)

    def delete(self, kind: str, key: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM docs WHERE kind=? AND id=?", (kind, key))

    # -- events ----------------------------------------------------------------------------
    def append_event(self, body: dict[str, Any], keep: int = 100_000) -> int:
        """Append one event; returns its number. Only the newest `keep` are kept."""
        with self._lock:
            seq = int(self._db.execute("INSERT INTO events (body) VALUES (?)", (json.dumps(body, default=str),)).lastrowid)
            if seq % 1000 == 0:
                self._db.execute("DELETE FROM events WHERE seq <= ?", (seq - keep,))
        return seq

    def events_after(self, seq: int, limit: int = 1000) -> list[dict[str, Any]]:
        """Events numbered above `seq`, oldest first, each with its `seq`."""
        with self._lock:
            rows = self._db.execute("SELECT seq, body FROM events WHERE seq > ? ORDER BY seq LIMIT ?",
                                    (seq, limit)).fetchall()
        return [{"seq": n, **json.loads(body)} for n, body in rows]

    def last_event_seq(self) -> int:
        with self._lock:
            row = self._db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'events'").fetchone()
        return int(row[0]) if row else 0

    # -- typed -----------------------------------------------------------------------------
    def save_worker(self, w: WorkerRecord) -> None:
        self.put("worker", w.id, w.to_dict())

    def worker(self, wid: str) -> WorkerRecord | None:
        d = self.get("worker", wid)
        return WorkerRecord.from_dict(d) if d else None

    def workers(self) -> list[WorkerRecord]:
        return [WorkerRecord.from_dict(d) for d in self.all("worker")]

    def delete_worker(self, wid: str) -> None:
        self.delete("worker", wid)

    def save_relocation(self, r: Relocation) -> None:
        self.put("relocation", r.id, r.to_dict())

    def relocation(self, rid: str) -> Relocation | None:
        d = self.get("relocation", rid)
        return Relocation.from_dict(d) if d else None

    def relocations(self) -> list[Relocation]:
        return [Relocation.from_dict(d) for d in self.all("relocation")]

    def open_relocations(self) -> list[Relocation]:
        return [r for r in self.relocations() if r.result == RUNNING]

    def save_demand(self, d: Demand) -> None:
        self.put("demand", d.id, d.to_dict())

    def demand(self, did: str) -> Demand | None:
        d = self.get("demand", did)
        return Demand.from_dict(d) if d else None

    def demands(self) -> list[Demand]:
        return [Demand.from_dict(d) for d in self.all("demand")]

    def delete_demand(self, did: str) -> None:
        self.delete("demand", did)
