"""Node agents: one Ray actor per node owning that node's cells (launch, dump, stream, restore)."""

from relocator.agent.agent import NAMESPACE, NodeAgent, agent_name, start_agent

__all__ = ["NAMESPACE", "NodeAgent", "agent_name", "start_agent"]
