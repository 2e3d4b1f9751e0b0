"""`relocator deploy | undeploy`: relocator on an existing (multi-host) Ray cluster."""

from __future__ import annotations

from typing import List, Optional

import typer
from rich.table import Table

from relocator.cli import app
from relocator.cli.common import console, err, fail, handle_errors, print_json

ADDRESS = typer.Option(..., "--address", "-a", help="the Ray cluster: ray://HEAD:10001 (Ray Client, from "
                       "anywhere) or HEAD:6379 / auto (from one of its nodes)")


def _preflight_table(report: dict) -> Table:
    t = Table(title="preflight, per host")
    for c in ("host", "ok", "hostname", "ip", "kernel", "criu", "cell subnet", "GPUs (Ray/real)", "failed"):
        t.add_column(c)
    for name, r in sorted(report.items()):
        t.add_row(name, "[green]yes[/]" if r["ok"] else "[red]no[/]", str(r.get("hostname")), str(r.get("ip")),
                  str(r.get("kernel")), str(r.get("criu")), str(r.get("cell_pool")),
                  f"{r.get('ray_gpus')}/{r.get('real_gpus')}", "; ".join(r.get("failed") or []))
    return t


@app.command("deploy")
@handle_errors
def deploy_cmd(address: str = ADDRESS,
               config: Optional[str] = typer.Option(None, "--config", "-c", help="YAML (default configs/deploy.yaml)"),
               cluster_dir: Optional[str] = typer.Option(None, "--cluster-dir", help="also describe the deployment "
                                                         "there (cluster.json), so that `relocator status|launch|"
                                                         "relocate ... --cluster-dir DIR` reach it"),
               api_key: List[str] = typer.Option([], "--api-key", help="a key clients must send the router "
                                                 "(Authorization: Bearer KEY), repeatable; also router.api_keys, "
                                                 "RELOCATOR_API_KEY"),
               insecure: bool = typer.Option(False, "--insecure", help="deploy on a Ray cluster without token "
                                             "authentication and serve the router beyond loopback without a key"),
               json_out: bool = typer.Option(False, "--json", help="print one JSON object")) -> None:
    """Start the controller, one agent per node with the `relocator` resource, and the router on a
    Ray cluster that already runs; the preflight runs on every host first (docs/deploy.md)."""
    from relocator.deploy import DeployConfig, DeployError, deploy

    cfg = DeployConfig.load(config, insecure=insecure or None)
    cfg.router.api_keys = [*cfg.router.api_keys, *api_key]
    try:
        out = deploy(address, cfg)
    except DeployError as exc:
        if exc.report:  # which host failed what, then the one-line error
            if json_out:
                print_json({"deployed": False, "error": str(exc), "preflight": exc.report})
            else:
                err.print(_preflight_table(exc.report))
        fail(str(exc), 1)
    if cluster_dir:
        from relocator.cluster.local import write_deployed

        write_deployed(cluster_dir, out)
    if json_out:
        print_json(out)
        return
    console.print(_preflight_table(out["preflight"]))
    console.print(f"[green]deployed[/] {out['id']} in {out['deploy_s']:.1f}s: {len(out['nodes'])} host(s), "
                  f"controller on {out['controller_node']['hostname']}, router {out['router_url']}, "
                  f"transfer {out['transfer']}")


@app.command("undeploy")
@handle_errors
def undeploy_cmd(address: str = ADDRESS,
                 cluster_dir: Optional[str] = typer.Option(None, "--cluster-dir", help="where deploy described it"),
                 json_out: bool = typer.Option(False, "--json", help="print one JSON object")) -> None:
    """Remove what `deploy` started: workers and their reservations, controller, router, agents,
    and the deployment's directory on every host."""
    from relocator.deploy import undeploy

    out = undeploy(address)
    if cluster_dir:
        from relocator.cluster.local import info_path, read_info

        if (read_info(cluster_dir) or {}).get("deployed"):
            info_path(cluster_dir).unlink(missing_ok=True)
    if json_out:
        print_json(out)
        return
    if not out["undeployed"]:
        console.print(out["reason"])
        return
    console.print(f"[green]undeployed[/] {out['id']}: actors {', '.join(out['killed_actors']) or 'none'}; "
                  f"hosts cleaned: {', '.join(sorted(out['hosts']))}")
    for e in out["errors"]:
        console.print(f"[yellow]{e}[/]")
