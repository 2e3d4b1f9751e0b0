"""The names agents are found by in Ray (one detached actor per node, in one namespace)."""

NAMESPACE = "relocator"


def agent_name(node: str) -> str:
    return f"relocator-agent-{node}"
