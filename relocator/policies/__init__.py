"""Policies that start moves: a trigger (gpu-health, node-notice, window, schedule, metric), a
filter (engine, model, priority, labels, GPU share) and an action (move, suspend, consolidate,
prefetch-image, cordon), loaded from `configs/policies.yaml` (docs/policies.md)."""
