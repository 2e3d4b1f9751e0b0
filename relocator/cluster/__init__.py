"""A local multi-node Ray cluster (several raylets with fake GPUs) plus router and controller."""

from relocator.cluster.config import LocalConfig, cluster_dir
from relocator.cluster.local import ClusterError, down, read_info, up

__all__ = ["ClusterError", "LocalConfig", "cluster_dir", "down", "read_info", "up"]
