"""relocator on an existing multi-host Ray cluster: `deploy`, `undeploy` (docs/deploy.md)."""

from relocator.deploy.config import DeployConfig
from relocator.deploy.deploy import DeployError, deploy, deployment, undeploy

__all__ = ["DeployConfig", "DeployError", "deploy", "deployment", "undeploy"]
