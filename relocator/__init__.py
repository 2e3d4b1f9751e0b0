"""relocator: move running LLM serving workers, with their traffic, without losing a token."""

__version__ = "0.1.0"


def connect(*args, **kwargs):
    """Attach to a running relocator cluster; see relocator.controller.api.connect."""
    from relocator.controller.api import connect as _connect

    return _connect(*args, **kwargs)


def start(*args, **kwargs):
    """Start a local relocator cluster and connect to it; see relocator.controller.api.start."""
    from relocator.controller.api import start as _start

    return _start(*args, **kwargs)
