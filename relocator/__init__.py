"""relocator: move running LLM serving workers, with their traffic, without losing a token."""

__version__ = "0.1.0"
