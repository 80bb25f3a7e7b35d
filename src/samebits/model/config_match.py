"""Is another checkpoint the same model? For `LLM.update_weights_from_disk`, which takes new
weights for the model the engine runs, never another shape."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from samebits.model.config_files import UnsupportedCheckpointError
from samebits.model.qwen3_moe.config import ModelConfig

# not part of the weights' shape: the stored dtype (cast on load), stop ids, and the
# architecture within a family (a full Omni checkpoint or its thinker alone)
IGNORED_FIELDS = ("torch_dtype", "eos_token_id", "architecture", "extra")


def config_differences(ours: ModelConfig, theirs: ModelConfig) -> list[tuple[str, object, object]]:
    """(field, ours, theirs) for each decoder field that differs, IGNORED_FIELDS aside."""
    out = []
    for f in dataclasses.fields(ModelConfig):
        a, b = getattr(ours, f.name), getattr(theirs, f.name)
        if f.name not in IGNORED_FIELDS and a != b:
            out.append((f.name, a, b))
    return out


def refuse_other_shape(diffs: list[tuple[str, object, object]], path: Path, where: str) -> None:
    """UnsupportedCheckpointError naming each differing field, when there is one."""
    if diffs:
        said = "; ".join(f"{name}: engine {a!r}, checkpoint {b!r}" for name, a, b in diffs)
        raise UnsupportedCheckpointError(
            f"{where}: {path}/config.json is another model shape ({said}); {where} takes "
            "checkpoints of the engine's own model: load this one in a new LLM instead"
        )
