"""Node agents: one Ray actor per node owning that node's cells (launch, dump, stream, restore).

Names are loaded on first use: the post-copy keeper (relocator.agent.postcopy, a process of its
own) starts without the agent's imports."""

from __future__ import annotations

from typing import Any

__all__ = ["NAMESPACE", "NodeAgent", "agent_name", "start_agent"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from relocator.agent import agent

        value = getattr(agent, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'relocator.agent' has no attribute {name!r}")
