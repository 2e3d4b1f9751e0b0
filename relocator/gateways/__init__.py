"""Gateway shells around the one router core (relocator.router): the LiteLLM plugin
(`litellm`), the Envoy ext_proc endpoint picker (`epp`). Each adapts its transport only; the
routing table, hold/switch, continuation and the control API come from relocator.router."""

from relocator.choices import Choice


class ViaRouter(Choice):
    """Which requests the endpoint picker sends through the relocator router (which continues
    them across a move) instead of straight to the worker."""

    NONE = "none"
    STREAMS = "streams"
    ALL = "all"
