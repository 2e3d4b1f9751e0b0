"""What `relocator deploy` refuses unless told `--insecure` (issue 26 items 3 and 4):

- a router reachable beyond loopback with no API key (`--api-key`, router.api_keys,
  router.api_key_file or RELOCATOR_API_KEY);
- a Ray cluster that lets a client without a token in (Ray's token authentication,
  RAY_AUTH_MODE=token, is off): anyone who reaches its ports runs code on every node as the
  raylet's user (root, for the agents).

The checks are pure functions of what was found; `anonymous_gcs_access` finds it on the cluster."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from relocator.router import auth

#: what Ray reads (ray/_private/authentication): the mode, the token itself or a file holding it
RAY_AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")

# a GCS client with no token asks the GCS for a key: answered = the cluster is open
_PROBE = """
import sys
from ray._raylet import GcsClient
try:
    GcsClient(address=sys.argv[1]).internal_kv_get(b"relocator/auth-probe", None, timeout=10)
except Exception as e:
    print("refused", type(e).__name__, str(e)[:200].replace(chr(10), " "))
else:
    print("open")
"""


def router_keys(api_keys: list[str], api_key_file: str | None) -> list[str]:
    """The deployed router's keys: the config's, its file's and RELOCATOR_API_KEY's."""
    keys = [*api_keys, *auth.env_keys()]
    if api_key_file:
        keys += auth.read_key_file(api_key_file)
    return list(dict.fromkeys(keys))


def router_problem(host: str, keys: list[str], insecure: bool) -> str | None:
    """Why a router on `host` may not start (None: it may)."""
    if keys or insecure or auth.is_loopback(host):
        return None
    return (f"the router would listen on {host} with no API key: pass --api-key KEY (or set "
            "router.api_keys / RELOCATOR_API_KEY), or --insecure to serve it unauthenticated")


def ray_problem(driver_has_token: bool, anonymous_ok: bool | None, insecure: bool) -> str | None:
    """Why the Ray cluster may not be deployed on (None: it may). `driver_has_token`: this
    process runs in Ray's token mode; `anonymous_ok`: a client without a token was answered
    (None: not probed). A driver without a token that got in proves the cluster open."""
    if insecure:
        return None
    if not driver_has_token or anonymous_ok:
        return ("the Ray cluster accepts clients without a token (Ray's token authentication is "
                "off): start it with RAY_AUTH_MODE=token and a token (RAY_AUTH_TOKEN or "
                "RAY_AUTH_TOKEN_PATH, docs/deploy.md), or pass --insecure")
    return None


def driver_has_token() -> bool:
    """Whether this process talks to Ray in token mode (RAY_AUTH_MODE=token, a token found)."""
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:  # a Ray without token authentication
        return False
    return is_token_auth_enabled()


def anonymous_gcs_access(gcs_address: str, timeout: float = 30.0) -> bool:
    """Whether a GCS client with no token (none in its environment, a HOME without
    ~/.ray/auth_token) is answered by the GCS at `gcs_address`. Runs where it is called: as a
    task on a node of the cluster it reaches the GCS as every raylet does."""
    import tempfile

    env = {k: v for k, v in os.environ.items() if k not in RAY_AUTH_ENV}
    with tempfile.TemporaryDirectory() as home:
        env.update(HOME=home, RAY_AUTH_MODE="disabled")
        try:
            out = subprocess.run([sys.executable, "-c", _PROBE, gcs_address], env=env, timeout=timeout,
                                 capture_output=True, text=True, stdin=subprocess.DEVNULL).stdout
        except subprocess.TimeoutExpired:
            return False  # no answer in time: not open to us
    return out.strip() == "open"


def cluster_anonymous_access() -> bool:
    """`anonymous_gcs_access` for the GCS of the cluster this driver is attached to, probed from
    one of its nodes (a Ray Client driver may not reach the GCS port itself)."""
    import ray

    def probe() -> bool:
        import ray

        return anonymous_gcs_access(ray.get_runtime_context().gcs_address)

    return ray.get(ray.remote(probe).options(num_cpus=0).remote(), timeout=120)


def key_file_text(keys: list[str]) -> str:
    return "".join(f"{k}\n" for k in keys)


def write_key_file(path: str | Path, keys: list[str]) -> Path:
    """The router's keys in a file only its owner reads (the router reads it at start)."""
    p = Path(path)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key_file_text(keys))
    return p
