"""SGLang engine adapter (real SGLang 0.5.x, CPU path on the reference machines): `adapter.Adapter`
(launch, readiness, metrics, fingerprint, native /generate continuation body), `launcher` (the
CRIU-friendly server entry point, run by .venv-sglang's interpreter), `stub_sgl_kernel` (a
stand-in for the compiled kernels, which have no CPU build). Importing this package loads
nothing heavy; SGLang itself is never imported into relocator's own environment."""
