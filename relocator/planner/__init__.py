"""relocator.planner: pure placement and defragmentation planning (no Ray, no I/O).

The controller calls::

    from relocator import planner
    cluster = planner.Cluster([planner.NodeSpec("n1", 64000, 262144, 8, "A100"), ...])
    cluster.add(planner.Workload("w1", 8000, 32768, num_gpu=2, gpu_milli=1000), "n1")
    planner.place(cluster, workload, policy="fgd")          # Placement | None
    planner.defragment(cluster, workload, max_moves=4)      # Plan | None (moves, then placement)
    planner.plan_gain_milli(cluster, plan, workload, cpu_per_gpu, mem_per_gpu)  # GPU share a plan wins
    planner.evacuate(cluster, "n1")                         # Plan (drain a node)
    planner.consolidate(cluster, max_moves=10)              # Plan (free whole nodes)
    planner.pack_shares(cluster, max_moves=6)               # Plan (free whole GPUs of shares, by FGD's score)
    planner.consolidate(cluster, 10, policy=planner.RayGpuFGD(planner.target_shapes(cluster, ws)))  # FGD at Ray's GPUs
    planner.apply_plan(cluster, plan, workload)             # execute, each step checked
"""

from relocator.planner.cluster import (
    MILLI,
    Cluster,
    Move,
    NodeSpec,
    Placement,
    Plan,
    PlannerError,
    Workload,
)
from relocator.planner.planners import (
    apply_plan,
    consolidate,
    defragment,
    evacuate,
    place,
    placeable_elsewhere,
    plan_gain_milli,
    usable_gpu_milli,
    victim_sets,
)
from relocator.planner.fall import RayGpuFGD, target_shapes
from relocator.planner.packing import free_gpus, pack_shares
from relocator.planner.policies import (
    BestFitPolicy,
    DotProductPolicy,
    FGDPolicy,
    PlacementPolicy,
    Policy,
    RandomPolicy,
    TypicalPods,
    canonical_policy_name,
    cluster_fragmentation_milli,
    fragmentation,
    get_policy,
    policy_names,
    register_policy,
)

__all__ = [
    "MILLI",
    "BestFitPolicy",
    "Cluster",
    "DotProductPolicy",
    "FGDPolicy",
    "Move",
    "NodeSpec",
    "Placement",
    "PlacementPolicy",
    "Plan",
    "PlannerError",
    "RayGpuFGD",
    "Policy",
    "RandomPolicy",
    "TypicalPods",
    "Workload",
    "apply_plan",
    "canonical_policy_name",
    "cluster_fragmentation_milli",
    "consolidate",
    "defragment",
    "evacuate",
    "fragmentation",
    "free_gpus",
    "get_policy",
    "pack_shares",
    "place",
    "placeable_elsewhere",
    "plan_gain_milli",
    "policy_names",
    "register_policy",
    "target_shapes",
    "usable_gpu_milli",
    "victim_sets",
]
