"""torch.distributed plumbing for the data-parallel RL loop: process group, FSDP2 trainer, gathers.

The trainer is built on the meta device, sharded with FSDP2 (`fully_shard` per decoder
layer, then the root), and only then given storage: each rank's device memory holds its
shards, never the whole fp32 model. The values come from a host (CPU) copy loaded by
transformers itself (so every checkpoint naming it converts is handled), one tensor at a
time, and that copy is dropped before training starts.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_process_group(device: str) -> tuple[int, int, str]:
    """Join the torchrun job (env:// rendezvous) -> (rank, world size, this rank's device).

    gloo for CPU, NCCL for CUDA (then the device is cuda:LOCAL_RANK)."""
    cuda = torch.device(device).type == "cuda"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    return dist.get_rank(), dist.get_world_size(), device


def shard(model, param_dtype: torch.dtype | None, device_type: str):
    """FSDP2: `fully_shard` each decoder layer, then the root (embeddings, final norm, lm_head).

    param_dtype: the dtype of the unsharded params in forward/backward (None: as stored);
    gradients are reduced in float32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def load_sharded_trainer(
    path,
    device: str,
    param_dtype: torch.dtype | None,
    experts_implementation: str,
    attn_implementation: str,
    samebits_forwards: bool = True,
):
    """The transformers model with float32 master weights, FSDP2-sharded over the world.

    Meta-device build -> `shard` -> `to_empty` -> each parameter's shard copied from the
    host copy (cast to float32 on the device one tensor at a time, sliced without any
    communication) -> rotary `inv_freq` set to the CPU fp32 formula -> samebits' forwards for
    the linears and norms (`trainer.use_samebits_forwards`) unless `samebits_forwards` is False."""
    from torch.distributed.tensor import distribute_tensor
    from transformers import AutoModelForCausalLM

    from samebits import trainer

    host = AutoModelForCausalLM.from_pretrained(path, dtype="auto", use_kernels=False)  # checkpoint dtype, host
    trainer.check_transformers_numerics(host)  # before the build: this transformers has the engine's bits
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            host.config,
            dtype=torch.float32,
            experts_implementation=experts_implementation,
            attn_implementation=attn_implementation,
        )
    shard(model, param_dtype, torch.device(device).type)
    model.to_empty(device=device)
    source = dict(host.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = source[name].detach().to(device=device, dtype=torch.float32)
            local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
            if local.shape != p.to_local().shape:
                raise RuntimeError(f"{name}: shard {tuple(local.shape)} != FSDP's {tuple(p.to_local().shape)}")
            p.to_local().copy_(local)
            del full, local
    del host, source
    trainer.reset_rotary_inv_freq(model)
    if samebits_forwards:
        trainer.use_samebits_forwards(model, check=False)  # checked on the host copy above
    model.eval()
    return model


def full_tensor(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The whole parameter in `dtype`: cast the shard (elementwise: the same bits as casting
    the whole) then all-gather it (`DTensor.full_tensor`); a plain tensor is only cast."""
    p = p.to(dtype)
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def to_float(x) -> float:
    """A scalar tensor or DTensor (e.g. clip_grad_norm_'s total norm) -> float."""
    return float(x.full_tensor() if hasattr(x, "full_tensor") else x)


def all_reduce_max(value: int, device: str) -> int:
    t = torch.tensor([value], device=device if torch.device(device).type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)
