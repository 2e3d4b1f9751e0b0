"""vLLM engine adapter (real vLLM; the CPU build on the reference machines): `adapter.Adapter`
(launch, readiness, metrics, fingerprint), `codec.Codec` (the router's continuation),
`outtext` (vLLM's text making, replayed), `launcher` (the CRIU-friendly server entry point).
Imported lazily by name: importing this package loads nothing heavy."""
