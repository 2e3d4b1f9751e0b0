"""OpenAI-compatible router that moves traffic with a relocated worker.

The core (`core`, `table`, `policies`, `stream`, `tokenizers`, `errors`) has no transport
dependency; each replica's engine codec comes from adapters/ (`adapters.base.get_codec`);
`server` is the aiohttp front end, `client` the control-API client."""

from .core import Hooks, RouterCore, Stream, Unary, Upstream, UpstreamError, UpstreamResponse
from .errors import RouterError
from .policies import POLICIES, Policy, make_policy, register_policy
from .table import Replica, ReplicaState, RoutingTable

__all__ = ["Hooks", "RouterCore", "Stream", "Unary", "Upstream", "UpstreamError",
           "UpstreamResponse", "RouterError", "POLICIES", "Policy", "make_policy",
           "register_policy", "Replica", "ReplicaState", "RoutingTable"]
