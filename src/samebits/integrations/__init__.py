"""Adapters through which an RL framework's own code drives samebits (docs/integrations.md).

`samebits.integrations.trl`: a `rollout_func` for TRL's `GRPOTrainer`, and TRL's log-prob
recompute made exact. `samebits.integrations.verl`: a verl `RolloutReplica` named "samebits",
its server (a Ray actor over the engine) and the trainer-side weight sync. Each adapter imports
its framework only when it is imported itself.
"""
