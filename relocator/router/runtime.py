"""What every shell around the router core shares, built once from `RouterSettings`: the
routing table (from the settings' backends, then the state file), the tokenizers, the
Prometheus hooks, the upstream pool and the `RouterCore` itself.

The standalone aiohttp router (server.py), the LiteLLM plugin (relocator.gateways.litellm) and
the Envoy endpoint picker (relocator.gateways.epp) each hold one `RouterRuntime` and serve the
same control API on it (control.py); each adapts only its own transport."""

from __future__ import annotations

import logging

from . import state as state_io
from .config import RouterSettings
from .core import RouterCore
from .metrics import PromHooks
from .policies import make_policy
from .table import RoutingTable
from .tokenizers import TokenizerRegistry
from .upstream import AiohttpUpstream

log = logging.getLogger(__name__)


def make_table(s: RouterSettings, table_cls: type[RoutingTable] = RoutingTable,
               **kw) -> RoutingTable:
    return table_cls(make_policy(s.policy, **s.policy_args), hold_queue_max=s.hold_queue_max,
                     hold_timeout_s=s.hold_timeout_s,
                     prefer_sibling_when_held=s.prefer_sibling_when_held, **kw)


class RouterRuntime:
    """One router core and its state. `start()` (in the serving event loop) opens the upstream
    pool and builds the core; `close()` undoes it. The table and tokenizers exist from the
    start, so replicas can be added before the first request."""

    def __init__(self, settings: RouterSettings | None = None,
                 table: RoutingTable | None = None) -> None:
        self.settings = s = settings or RouterSettings()
        self.table = table if table is not None else make_table(s)
        #: per model, the tokenizer continued streams' text is made with
        self.tokenizers = TokenizerRegistry()
        for i, b in enumerate(s.backends):
            self.table.add(b.worker_id or f"{b.model}-{i}", b.model, b.url,
                           b.engine.value if b.engine else None)
            if b.tokenizer:
                self.tokenizers.register(b.model, b.tokenizer)
        if s.state_file is not None:  # newer than the config: it wins
            reps = state_io.load(s.state_file)
            if reps:
                log.info("router state: %d replicas from %s",
                         state_io.restore(self.table, reps), s.state_file)
                for model, path in state_io.tokenizers_of(reps).items():
                    self.tokenizers.register(model, path)
        self.hooks = PromHooks()
        self.table.on_held_change = self.hooks.held_changed
        self.upstream: AiohttpUpstream | None = None
        self.core: RouterCore | None = None

    def start(self) -> RouterCore:
        """Open the upstream pool and build the core (idempotent; needs a running loop)."""
        if self.core is None:
            s = self.settings
            self.upstream = AiohttpUpstream(s.connect_timeout_s, s.pool_limit,
                                            s.upstream_dead_peer_s)
            self.core = RouterCore(self.table, self.upstream, engine=s.engine.value,
                                   max_body_bytes=s.max_body_bytes, retries=s.retries,
                                   max_continuations=s.max_continuations,
                                   continuation=s.continuation, hooks=self.hooks,
                                   unreachable_hold_s=s.unreachable_hold_s,
                                   probe=self.upstream.health, tokenizers=self.tokenizers)
        return self.core

    async def close(self) -> None:
        if self.core is not None:
            self.core.close()
        if self.upstream is not None:
            await self.upstream.close()

    def persist(self) -> None:
        """Write the table after a control-API change (no-op without `state_file`)."""
        path = self.settings.state_file
        if path is None:
            return
        try:
            state_io.save(path, self.table, self.tokenizers.paths)
        except OSError as e:
            log.warning("router state %s not written: %s", path, e)
