"""Adapters through which an RL framework's own code drives samebits (docs/integrations.md).

`samebits.integrations.trl`: a `rollout_func` for TRL's `GRPOTrainer`, and TRL's log-prob
recompute made exact. Each adapter imports its framework only when it is imported itself.
"""
