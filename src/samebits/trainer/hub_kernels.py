"""Hub kernels in a transformers trainer: found, switched back, or refused.

From transformers 5.25, `from_pretrained` kernelizes by default when the `kernels` package is
installed (`use_kernels=None` means on): on CUDA, RMSNorm becomes
`kernels-community/liger-kernels` `LigerRMSNorm` and `apply_rotary_pos_emb` becomes
`kernels-community/rotary`. `kernelize` puts a kernel in place by setting the module's own
`forward` (in its `__dict__`) and recording the repository as `_kernel_repo`, for modules and
for the function wrappers an attention keeps in `_kernel_funcs`. Those kernels compute other
bits than transformers' modules, which the engine follows. samebits' loaders pass
`use_kernels=False`; a model that was kernelized anyway has its kernels switched back to
transformers' forwards, with a warning naming them.
"""

from __future__ import annotations

import warnings

from torch import nn


class HubKernelError(RuntimeError):
    """A hub kernel in the trainer that samebits could not switch back, or one asked for."""


def kernelized(model: nn.Module) -> list[tuple[str, nn.Module, object]]:
    """(name, module, repository) of every module or kernel function in `model` whose forward
    a hub kernel replaced."""
    found = []
    for name, module in model.named_modules():
        if "_kernel_repo" in module.__dict__:
            found.append((name or type(module).__name__, module, module.__dict__["_kernel_repo"]))
        for func_name, func in module.__dict__.get("_kernel_funcs", {}).items():
            if "_kernel_repo" in func.__dict__:
                found.append(
                    (f"{name}.{func_name}" if name else func_name, func, func.__dict__["_kernel_repo"])
                )
    return found


def switch_back(model: nn.Module) -> None:
    """Give every hub-kernelized module of `model` its class's forward again, and turn the
    model's `use_kernels` off (so `model.train()` does not kernelize it again), warning with the
    names and repositories; raise HubKernelError if any is left."""
    found = kernelized(model)
    uses_kernels = bool(getattr(model, "_use_kernels", False))
    if not found and not uses_kernels:
        return
    if uses_kernels:
        model._use_kernels = False  # what transformers' own `reset_kernels` sets
        model._kernels_mode = None
    for _, module, _ in found:
        module.__dict__.pop("forward", None)
        module.__dict__.pop("_kernel_repo", None)
    if found:
        names = ", ".join(f"{name} ({repo})" for name, _, repo in found)
        warnings.warn(
            f"samebits switched {len(found)} hub kernel(s) back to transformers' forwards: {names}. "
            "Their bits are not transformers' modules', which samebits' engine computes; load the "
            "model with use_kernels=False to keep them out.",
            stacklevel=3,
        )
    left = kernelized(model)
    if left:
        raise HubKernelError(
            "hub kernels are still in the trainer after switching back: "
            + ", ".join(name for name, _, _ in left)
            + "; load the model with use_kernels=False"
        )


def refuse_hub_kernels(kwargs: dict) -> dict:
    """`from_pretrained` kwargs for samebits' loaders: hub kernels asked for are refused,
    otherwise `use_kernels=False` (transformers 5.25 kernelizes by default)."""
    if kwargs.get("use_kernels") or kwargs.get("kernel_config") is not None:
        raise HubKernelError(
            "use_kernels/kernel_config asked for hub kernels; their bits are not transformers' "
            "modules', which samebits' engine computes. Leave them out (samebits loads with "
            "use_kernels=False)."
        )
    kwargs.pop("kernel_config", None)
    kwargs["use_kernels"] = False
    return kwargs
