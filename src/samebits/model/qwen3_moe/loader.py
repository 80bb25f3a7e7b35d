"""Loading a local HF Qwen3-MoE checkpoint into HF-named tensors (fused experts layout).

Accepts one `model.safetensors` or shards listed by `model.safetensors.index.json`;
experts fused (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
[E, H, I]) or per expert (`mlp.experts.N.{gate,up,down}_proj.weight`, the layout
transformers 5.x `save_pretrained` writes by default), stacked layer by layer.

Every name, shape and dtype is checked from the safetensors headers before any
tensor is read, so a bad checkpoint is refused at once and by name; values are
checked finite as they arrive (`checkpoint_checks`, shared with the trainer).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from samebits.model import checkpoint_checks as checks
from samebits.model.checkpoint_checks import INDEX_FILE, SINGLE_FILE
from samebits.model.qwen3_moe.config import ModelConfig, UnsupportedCheckpointError
from samebits.progress import maybe_progress

# model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight -> (layer prefix, e, kind)
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_IGNORED = checks.DERIVED_TENSORS  # buffers some exporters save
_FLOAT_DTYPES = checks.FLOAT_DTYPES
_listing = checks.listing
_weight_files = checks.weight_files


@dataclass(frozen=True)
class _OnDisk:
    """One tensor as the safetensors header describes it (nothing read yet)."""

    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors spelling: "BF16", "F32", "I8", "F8_E4M3", ...


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model with its shape, in HF state_dict order.

    Fused experts layout; `lm_head.weight` is listed even when tied.
    """
    h, d, v = cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for proj, (rows, cols) in {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q)}.items():
            shapes[f"{p}self_attn.{proj}_proj.weight"] = (rows, cols)
            if cfg.attention_bias:
                shapes[f"{p}self_attn.{proj}_proj.bias"] = (rows,)
        shapes[p + "self_attn.q_norm.weight"] = (d,)
        shapes[p + "self_attn.k_norm.weight"] = (d,)
        if cfg.is_sparse_layer(i):
            e, inter = cfg.num_experts, cfg.moe_intermediate_size
            shapes[p + "mlp.experts.gate_up_proj"] = (e, 2 * inter, h)
            shapes[p + "mlp.experts.down_proj"] = (e, h, inter)
            shapes[p + "mlp.gate.weight"] = (e, h)
        else:
            inter = cfg.intermediate_size
            shapes[p + "mlp.gate_proj.weight"] = (inter, h)
            shapes[p + "mlp.up_proj.weight"] = (inter, h)
            shapes[p + "mlp.down_proj.weight"] = (h, inter)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (v, h)
    return shapes


def load_state_dict(
    path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read `config.json` and the safetensors weights of a checkpoint directory.

    Returns the config and the tensors under the names of `expected_shapes(cfg)`, all of
    one dtype (`dtype`, else the checkpoint's; a checkpoint mixing dtypes gets the one
    config.json declares) on `device`. With tied embeddings `lm_head.weight` is the same
    tensor object as `model.embed_tokens.weight`. Raises UnsupportedCheckpointError naming
    the tensors when anything is missing, unexpected, mis-shaped, not a float or not finite,
    and naming the file when a weight file or the index is corrupt.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    cfg = ModelConfig.from_pretrained(path)
    files = _weight_files(path)
    on_disk = {n: t for n, t in _read_headers(files).items() if not _IGNORED.search(n)}
    _refuse_quantised(on_disk)
    per_expert = {m.group(1) for n in on_disk if (m := _PER_EXPERT.match(n))}
    _check_names_and_shapes(cfg, on_disk, _disk_shapes(cfg, per_expert))
    target = dtype or _checkpoint_dtype(cfg, on_disk)
    with ExitStack() as stack:
        handles = {f: stack.enter_context(checks.open_safetensors(f)) for f in files}
        state = _read_all(cfg, on_disk, handles, per_expert, target, device, many=len(files) > 1)
    checks.refuse_non_finite(state.items(), f"checkpoint {path}")
    return cfg, state


def shared_state_dict(
    cfg: ModelConfig, named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, device: str
) -> dict[str, torch.Tensor]:
    """An engine state made of tensors it will share, not copy (a colocated trainer's own
    parameters). Checked like a checkpoint (every name and shape against `cfg`); each tensor
    must already be a dense, contiguous `dtype` tensor on `device`. Returned detached: the
    same storage, but nothing the engine sets on its parameters reaches the given objects."""
    state = {}
    for name, t in named_tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"shared weights: {name} is a {type(t).__name__}, not a tensor")
        state[name] = t
    try:
        _check_names_and_shapes(cfg, state, expected_shapes(cfg))
    except UnsupportedCheckpointError as e:
        raise ValueError(f"shared weights do not match the checkpoint's config.json: {e}") from None
    checks.refuse_non_finite(state.items(), "shared weights")
    want = torch.device(device)
    for name, t in state.items():
        if t.is_meta or t.layout != torch.strided or hasattr(t, "device_mesh") or not t.is_contiguous():
            raise ValueError(f"shared weights: {name} must be a plain, dense, contiguous tensor with data")
        if t.dtype != dtype:
            raise ValueError(f"shared weights: {name} is {t.dtype}, but the engine runs {dtype}")
        if t.device.type != want.type or (want.index is not None and t.device.index != want.index):
            raise ValueError(f"shared weights: {name} is on {t.device}, but the engine runs on {want}")
    return {name: t.detach() for name, t in state.items()}


def _read_headers(files: list[Path]) -> dict[str, _OnDisk]:
    out: dict[str, _OnDisk] = {}
    for f in files:
        with checks.open_safetensors(f) as fh:
            for name in fh.keys():
                if name in out:
                    raise UnsupportedCheckpointError(
                        f"tensor {name} is stored twice, in {out[name].file.name} and {f.name}"
                    )
                sl = fh.get_slice(name)
                out[name] = _OnDisk(f, tuple(sl.get_shape()), sl.get_dtype())
    return out


def _refuse_quantised(on_disk: dict[str, _OnDisk]) -> None:
    checks.refuse_non_float({n: t.dtype for n, t in on_disk.items()})


def _disk_shapes(cfg: ModelConfig, per_expert: set[str]) -> dict[str, tuple[int, ...]]:
    """expected_shapes, with the per-expert names for the layers stored that way."""
    shapes = expected_shapes(cfg)
    inter, h = cfg.moe_intermediate_size, cfg.hidden_size
    for prefix in per_expert:
        if shapes.pop(prefix + ".gate_up_proj", None) is None:
            continue  # a dense layer: its expert tensors stay unexpected
        del shapes[prefix + ".down_proj"]
        for e in range(cfg.num_experts):
            shapes[f"{prefix}.{e}.gate_proj.weight"] = (inter, h)
            shapes[f"{prefix}.{e}.up_proj.weight"] = (inter, h)
            shapes[f"{prefix}.{e}.down_proj.weight"] = (h, inter)
    return shapes


def _check_names_and_shapes(cfg: ModelConfig, on_disk: dict[str, _OnDisk], shapes: dict) -> None:
    missing = [n for n in shapes if n not in on_disk]
    if cfg.tie_word_embeddings and "lm_head.weight" in missing:
        missing.remove("lm_head.weight")
    experts = [n for n in missing if _PER_EXPERT.match(n)]
    if experts:
        raise UnsupportedCheckpointError(
            f"per-expert layout is missing {len(experts)} expert tensor(s): {_listing(experts)}; "
            f"config.json says num_experts={cfg.num_experts}"
        )
    if missing:
        raise UnsupportedCheckpointError(
            f"{len(missing)} tensor(s) missing from the checkpoint: {_listing(missing)}"
        )
    unexpected = [n for n in on_disk if n not in shapes]
    if unexpected:
        raise UnsupportedCheckpointError(
            f"{len(unexpected)} unexpected tensor(s) in the checkpoint: {_listing(unexpected)}; "
            "is it a Qwen3-MoE checkpoint matching its config.json?"
        )
    bad = [f"{n}: expected {shapes[n]}, got {t.shape}" for n, t in on_disk.items() if t.shape != shapes[n]]
    if bad:
        raise UnsupportedCheckpointError(f"{len(bad)} mis-shaped tensor(s): {_listing(bad)}")


def _checkpoint_dtype(cfg: ModelConfig, on_disk: dict[str, _OnDisk]) -> torch.dtype:
    found = {_FLOAT_DTYPES[t.dtype] for t in on_disk.values()}
    if len(found) == 1:
        return found.pop()
    declared = getattr(torch, cfg.torch_dtype.removeprefix("torch."), None)
    if declared in found:
        return declared
    raise UnsupportedCheckpointError(
        f"checkpoint mixes dtypes {sorted(map(str, found))} and config.json declares "
        f"{cfg.torch_dtype!r}; pass dtype= to cast them to one"
    )


def _read_all(
    cfg: ModelConfig,
    on_disk: dict[str, _OnDisk],
    handles: dict,
    per_expert: set[str],
    dtype: torch.dtype,
    device: str | torch.device,
    many: bool,
) -> dict[str, torch.Tensor]:
    def read(name: str) -> torch.Tensor:
        return handles[on_disk[name].file].get_tensor(name).to(device=device, dtype=dtype)

    shapes = expected_shapes(cfg)
    names = list(shapes)
    state: dict[str, torch.Tensor] = {}
    for name in maybe_progress(names, "loading weights") if many else names:
        prefix, _, part = name.rpartition(".")
        if name in state:  # read with its layer's q_proj
            continue
        if name.endswith(_QKV[0]):
            state.update(_read_qkv(name.removesuffix(_QKV[0]), shapes, read, device, dtype))
        elif prefix in per_expert and part in ("gate_up_proj", "down_proj"):
            state[name] = _stack_experts(cfg, prefix, part, read, device, dtype)
        elif name == "lm_head.weight" and cfg.tie_word_embeddings:
            state[name] = state["model.embed_tokens.weight"]
            if name in on_disk:
                _check_tied(read(name), state[name])
        else:
            state[name] = read(name)
    return {name: state[name] for name in names}  # in the config's order (q/k/v came early)


_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")


def _read_qkv(layer: str, shapes: dict, read, device, dtype) -> dict[str, torch.Tensor]:
    """One layer's q, k and v projection weights, read into adjacent rows of one buffer
    [Nq + Nk + Nv, H]: each is a view, and on CUDA the model runs the three as one GEMM over
    the buffer (`ops.projections`), which gives each column the bits it has alone."""
    names = [layer + part for part in _QKV]
    rows = [shapes[n][0] for n in names]
    buf = torch.empty(sum(rows), shapes[names[0]][1], dtype=dtype, device=device)
    out, start = {}, 0
    for name, n in zip(names, rows, strict=True):
        out[name] = buf[start : start + n]
        out[name].copy_(read(name))
        start += n
    return out


def _stack_experts(cfg, prefix, part, read, device, dtype) -> torch.Tensor:
    """Fill one layer's fused tensor expert by expert: gate_up[e] = [gate_e; up_e] on dim 0."""
    e_count, inter, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    if part == "down_proj":
        out = torch.empty(e_count, h, inter, dtype=dtype, device=device)  # [E, H, I]
        for e in range(e_count):
            out[e] = read(f"{prefix}.{e}.down_proj.weight")
        return out
    out = torch.empty(e_count, 2 * inter, h, dtype=dtype, device=device)  # [E, 2I, H]
    for e in range(e_count):
        out[e, :inter] = read(f"{prefix}.{e}.gate_proj.weight")
        out[e, inter:] = read(f"{prefix}.{e}.up_proj.weight")
    return out


def _check_tied(head: torch.Tensor, embed: torch.Tensor) -> None:
    if not torch.equal(head, embed):
        raise UnsupportedCheckpointError(
            "tie_word_embeddings is true but lm_head.weight differs from "
            "model.embed_tokens.weight; fix tie_word_embeddings in config.json"
        )


def save_state_dict(
    cfg_dict: dict,
    state: dict[str, torch.Tensor],
    path: str | Path,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write `config.json` and the tensors as safetensors, as given (names unchanged).

    One `model.safetensors`, or shards of at most `max_shard_bytes` (a larger tensor gets
    a shard of its own) with a `model.safetensors.index.json`. A tied `lm_head.weight`
    (sharing storage with the embedding) is left out, as transformers does. Weight files
    of an earlier save in `path` are removed first so the two cannot mix.
    """
    tensors = {n: t for n, t in state.items() if not _is_tied(n, state)}
    if max_shard_bytes is not None:
        return save_tensor_stream(cfg_dict, tensors.items(), path, max_shard_bytes)
    path = Path(path)
    _clear_weights(path)
    (path / "config.json").write_text(json.dumps(cfg_dict, indent=2, sort_keys=True) + "\n")
    tensors = {n: t.detach().contiguous().cpu() for n, t in tensors.items()}
    save_file(tensors, str(path / SINGLE_FILE), metadata={"format": "pt"})
    return path


def save_tensor_stream(
    cfg_dict: dict, named_tensors: Iterable[tuple[str, torch.Tensor]], path: str | Path, max_shard_bytes: int
) -> Path:
    """Write tensors as they come into shards of at most `max_shard_bytes` (a larger tensor
    gets a shard of its own), with `config.json` and the index: host memory holds one shard
    at a time, so a 61 GB checkpoint can be written from a generator of device tensors."""
    path = Path(path)
    _clear_weights(path)
    (path / "config.json").write_text(json.dumps(cfg_dict, indent=2, sort_keys=True) + "\n")
    files: list[list[str]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        save_file(shard, str(path / f"shard-{len(files):05d}.tmp"), metadata={"format": "pt"})
        files.append(list(shard))
        shard.clear()

    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
            size = 0
        shard[name] = t.detach().contiguous().cpu()
        size, total = size + nbytes, total + nbytes
    if shard or not files:
        flush()
    weight_map = {}
    for i, names in enumerate(files):
        fname = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        (path / f"shard-{i:05d}.tmp").replace(path / fname)
        weight_map |= dict.fromkeys(names, fname)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return path


def _clear_weights(path: Path) -> None:
    """Make `path`; remove an earlier save's weight files (and an interrupted stream's
    shards) from it so the two cannot mix."""
    path.mkdir(parents=True, exist_ok=True)
    for old in [*path.glob("model*.safetensors"), *path.glob("shard-*.tmp"), path / INDEX_FILE]:
        old.unlink(missing_ok=True)


def _is_tied(name: str, state: dict[str, torch.Tensor]) -> bool:
    embed = state.get("model.embed_tokens.weight")
    return (
        name == "lm_head.weight"
        and embed is not None
        and state[name].untyped_storage().data_ptr() == embed.untyped_storage().data_ptr()
    )
