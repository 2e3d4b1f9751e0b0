"""Direct probes of a worker's endpoint (max_tokens=1), to time when it serves again after a fault."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

from relocator import waits
from relocator.chaos.config import MODEL


def _post_ok(url: str, timeout: float = 5.0) -> bool:
    from relocator.router.auth import client_headers

    body = json.dumps({"model": MODEL, "prompt": "probe", "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(url.rstrip("/") + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json", **client_headers()})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status == 200 and b"choices" in r.read()
    except Exception:  # noqa: BLE001
        return False


def _kill(pid: int, sig: int = signal.SIGKILL) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


class _Probe:
    """Probes endpoints directly (max_tokens=1) on a thread and records when each answered."""

    SLOW_S = 1.0  # a probe answered later than this was sent to a worker that was not serving

    def __init__(self) -> None:
        self.endpoints: list[str] = []
        self.ok: dict[str, list[tuple[float, float | None]]] = {}  # endpoint -> [(sent, answered)]
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def add(self, ep: str | None) -> None:
        if ep and ep not in self.endpoints:
            self.endpoints.append(ep)

    def _one(self, ep: str) -> None:
        def probe() -> None:
            t0 = time.time()
            ok = _post_ok(ep, timeout=5.0)
            self.ok.setdefault(ep, []).append((t0, time.time() if ok else None))

        while not self._stop.is_set():  # one new probe every 50 ms, not waiting for the last
            threading.Thread(target=probe, daemon=True).start()
            self._stop.wait(0.05)

    def _run(self) -> None:
        started: set[str] = set()
        while not self._stop.is_set():
            for ep in list(self.endpoints):
                if ep not in started:
                    started.add(ep)
                    threading.Thread(target=self._one, args=(ep,), daemon=True).start()
            self._stop.wait(0.02)

    def start(self) -> "_Probe":
        self._t.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def serving_at(self, ep: str, since: float, wait_s: float = 5.0) -> float | None:
        """When `ep` was serving again for good after `since`: the answer to the first prompt
        probe (within SLOW_S) sent after the last probe that failed or was slow."""
        return serving_again_at(self.answers(ep, since, wait_s), self.SLOW_S)

    def answers(self, ep: str, since: float, wait_s: float = 5.0) -> list[tuple[float, float | None]]:
        def probes() -> list[tuple[float, float | None]]:
            return sorted(x for x in list(self.ok.get(ep, [])) if x[0] >= since - 0.05)

        waits.settle(lambda: any(b is not None and b - a <= self.SLOW_S for a, b in probes()), wait_s, every=0.05)
        return probes()


def serving_again_at(probes: list[tuple[float, float | None]], slow_s: float = 1.0) -> float | None:
    """`probes`: (sent, answered or None), sorted by sent. The answer time of the first good
    probe (answered within `slow_s`) sent after the last bad one; None if none is good."""
    bad = [a for a, b in probes if b is None or b - a > slow_s]
    after = [b for a, b in probes if b is not None and b - a <= slow_s and (not bad or a > bad[-1])]
    return min(after) if after else None
