"""OpenAI-compatible router that moves traffic with a relocated worker.

The core (`core`, `table`, `policies`, `stream`, `engine`, `errors`) has no transport
dependency; `server` is the aiohttp front end, `client` the control-API client."""

from .core import Hooks, RouterCore, Stream, Unary, Upstream, UpstreamError, UpstreamResponse
from .engine import ContinuationEngine, VLLMEngine, make_engine
from .errors import RouterError
from .policies import POLICIES, Policy, make_policy, register_policy
from .table import Replica, ReplicaState, RoutingTable

__all__ = ["Hooks", "RouterCore", "Stream", "Unary", "Upstream", "UpstreamError",
           "UpstreamResponse", "ContinuationEngine", "VLLMEngine", "make_engine", "RouterError",
           "POLICIES", "Policy", "make_policy", "register_policy", "Replica", "ReplicaState",
           "RoutingTable"]
