"""Gateway shells around the one router core (relocator.router): the LiteLLM plugin
(`litellm`), the Envoy ext_proc endpoint picker (`epp`). Each adapts its transport only; the
routing table, hold/switch, continuation and the control API come from relocator.router."""
