"""The reference engine: a small OpenAI-compatible server that serves the project's tiny Llama
with plain torch, on CPU or CUDA (`server`, its core in `model`), for tests and for machines
that cannot install vLLM. It speaks vLLM's wire format (`return_token_ids` included) and makes
its text with vLLM's text making, so the router continues its streams with vLLM's codec.
`adapter.Adapter` (launch, readiness, metrics, fingerprint), `codec.Codec` (the router's side).
Importing this package loads nothing heavy."""

#: the reference engine's version (the fingerprint's engine_version)
__version__ = "0.1.0"
