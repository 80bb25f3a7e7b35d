"""The trainer's checked `from_pretrained`: what the engine refuses, the trainer refuses too.

transformers fills missing parameters with random values, drops unexpected ones,
casts fp64/int8/fp8 tensors to the requested dtype and loads NaN as readily as
anything else, all without an exception. `from_pretrained_checked` refuses each of
those by name, before the model is built where the headers tell (files, index,
dtypes) and right after loading for the rest (names, shapes, values).
"""

from __future__ import annotations

from samebits.model import checkpoint_checks as checks
from samebits.model.families import check_checkpoint_config
from samebits.model.hub import resolve_model_path


def from_pretrained_checked(model_cls, path, **kwargs):
    """`model_cls.from_pretrained(path, **kwargs)` on a local directory or a cached hub id,
    refusing (UnsupportedCheckpointError) a corrupt file or index, a non-float tensor, a
    missing, unexpected or mis-shaped tensor, and NaN or inf in any parameter or buffer."""
    path = resolve_model_path(path)
    check_checkpoint_config(path)  # the configs, refused as the engine refuses them
    checks.check_hf_files(path)
    kwargs.pop("output_loading_info", None)
    kwargs.setdefault("ignore_mismatched_sizes", True)  # reported below, by name, and refused
    model, info = model_cls.from_pretrained(path, output_loading_info=True, **kwargs)
    checks.check_hf_loading_info(info, path)
    named = [*model.named_parameters(remove_duplicate=True), *model.named_buffers()]
    checks.refuse_non_finite(named, f"checkpoint {path}")
    return model
