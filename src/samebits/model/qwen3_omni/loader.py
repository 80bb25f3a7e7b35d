"""Loading the Qwen3-Omni thinker's weights under transformers 5.x thinker names.

Reads a full Omni checkpoint (thinker weights under `thinker.`, talker and
code2wav weights beside them, which are skipped unread) or a thinker-only one.
Both namings transformers reads are accepted and mapped to the names of
`Qwen3OmniMoeThinkerForConditionalGeneration.named_parameters()`:

    released / save_pretrained         transformers 5.x modules
    model.{embed_tokens,layers,norm}   model.language_model.{...}
    visual.*                           model.visual.*
    audio_tower.*                      model.audio_tower.*
    lm_head.weight                     lm_head.weight

Experts may be fused or per expert (as for Qwen3-MoE). The text decoder goes
through the Qwen3-MoE loader's checks; the encoders' names and shapes are checked
against transformers' own encoder modules. A checkpoint without any vision (or
audio) tensors has no such encoder: requests using it are refused.
"""

from __future__ import annotations

import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from samebits.model import checkpoint_checks as checks
from samebits.model.config_files import UnsupportedCheckpointError
from samebits.model.qwen3_moe import loader
from samebits.model.qwen3_omni.config import OMNI_FULL, OmniConfig

TEXT, VISION, AUDIO = "model.language_model.", "model.visual.", "model.audio_tower."
_SKIPPED = ("talker.", "code2wav.")  # the full Omni model's speech parts
_RENAMES = (  # thinker-relative names as released -> transformers 5.x module names
    (re.compile(r"^model\.(?!language_model\.|visual\.|audio_tower\.)"), TEXT),
    (re.compile(r"^visual\."), VISION),
    (re.compile(r"^audio_tower\."), AUDIO),
)


@dataclass
class ThinkerWeights:
    """HF-named tensors of one thinker: the text decoder, lm_head, and each encoder present."""

    text: dict[str, torch.Tensor]  # Qwen3-MoE names (`model.layers.0...`, `lm_head.weight`)
    vision: dict[str, torch.Tensor] | None  # names inside the vision encoder (`blocks.0...`)
    audio: dict[str, torch.Tensor] | None  # names inside the audio encoder


def canonical_name(disk_name: str, architecture: str) -> str | None:
    """The transformers 5.x thinker name of a checkpoint tensor; None for talker/code2wav."""
    name = disk_name
    if architecture == OMNI_FULL:
        if name.startswith(_SKIPPED):
            return None
        if not name.startswith("thinker."):
            raise UnsupportedCheckpointError(
                f"tensor {disk_name} belongs to neither thinker, talker nor code2wav"
            )
        name = name.removeprefix("thinker.")
    for pattern, target in _RENAMES:
        name = pattern.sub(target, name, count=1)
    return name


def encoder_shapes(cfg: OmniConfig) -> tuple[dict, dict]:
    """{name: shape} of transformers' vision and audio encoders for this config (built on meta)."""
    vision_model, audio_model = _encoder_classes()
    hf = cfg.hf_thinker_config()
    with torch.device("meta"):
        vision = vision_model._from_config(hf.vision_config)
        audio = audio_model._from_config(hf.audio_config)
    return (
        {n: tuple(t.shape) for n, t in vision.state_dict().items()},
        {n: tuple(t.shape) for n, t in audio.state_dict().items()},
    )


def _encoder_classes():
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeAudioEncoder,
        Qwen3OmniMoeVisionEncoder,
    )

    return Qwen3OmniMoeVisionEncoder, Qwen3OmniMoeAudioEncoder


def load_thinker_weights(
    path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> tuple[OmniConfig, ThinkerWeights]:
    """Read the thinker's config and weights; talker/code2wav tensors are skipped unread.

    Raises UnsupportedCheckpointError naming the tensors when anything is missing,
    unexpected, stored twice, mis-shaped, not a float or not finite, and naming the file
    when a weight file or the index is corrupt.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    cfg = OmniConfig.from_pretrained(path)
    files = loader._weight_files(path)
    raw = loader._read_headers(files)
    disk_of: dict[str, str] = {}  # canonical -> disk name
    for disk in raw:
        name = canonical_name(disk, cfg.architecture)
        if name is None or loader._IGNORED.search(name):
            continue
        if name in disk_of:
            raise UnsupportedCheckpointError(f"tensor {name} is stored twice, as {disk_of[name]} and {disk}")
        disk_of[name] = disk
    on_disk = {n: raw[d] for n, d in disk_of.items()}
    loader._refuse_quantised(on_disk)
    groups = _split_groups(on_disk)
    target = dtype or loader._checkpoint_dtype(cfg.text, on_disk)
    vision_shapes, audio_shapes = encoder_shapes(cfg)
    with ExitStack() as stack:
        handles = {f: stack.enter_context(checks.open_safetensors(f)) for f in files}
        text = _read_text(cfg, groups["text"], disk_of, handles, target, device, many=len(files) > 1)
        vision = _read_encoder(
            "vision", VISION, groups["vision"], vision_shapes, disk_of, handles, target, device
        )
        audio = _read_encoder("audio", AUDIO, groups["audio"], audio_shapes, disk_of, handles, target, device)
    for part, tensors in (("", text), (VISION, vision), (AUDIO, audio)):
        checks.refuse_non_finite(((part + n, t) for n, t in (tensors or {}).items()), f"checkpoint {path}")
    return cfg, ThinkerWeights(text, vision, audio)


def _split_groups(on_disk: dict) -> dict[str, dict]:
    groups: dict[str, dict] = {"text": {}, "vision": {}, "audio": {}}
    unexpected = []
    for name, t in on_disk.items():
        if name.startswith(TEXT):
            groups["text"]["model." + name.removeprefix(TEXT)] = t
        elif name == "lm_head.weight":
            groups["text"][name] = t
        elif name.startswith(VISION):
            groups["vision"][name] = t
        elif name.startswith(AUDIO):
            groups["audio"][name] = t
        else:
            unexpected.append(name)
    if unexpected:
        raise UnsupportedCheckpointError(
            f"{len(unexpected)} unexpected thinker tensor(s): {loader._listing(unexpected)}"
        )
    return groups


class _Renamed:
    """A safetensors handle read by canonical names."""

    def __init__(self, handle, disk_of: dict[str, str], prefix: str = ""):
        self._handle, self._disk_of, self._prefix = handle, disk_of, prefix

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._handle.get_tensor(self._disk_of[self._prefix + name])


def _text_disk_name(disk_of: dict[str, str]) -> dict[str, str]:
    """Qwen3-MoE text names (`model.layers...`) -> disk names."""
    out = {}
    for name, disk in disk_of.items():
        if name.startswith(TEXT):
            out["model." + name.removeprefix(TEXT)] = disk
        elif name == "lm_head.weight":
            out[name] = disk
    return out


def _read_text(cfg: OmniConfig, on_disk, disk_of, handles, dtype, device, many) -> dict[str, torch.Tensor]:
    text_disk = _text_disk_name(disk_of)
    per_expert = {m.group(1) for n in on_disk if (m := loader._PER_EXPERT.match(n))}
    loader._check_names_and_shapes(cfg.text, on_disk, loader._disk_shapes(cfg.text, per_expert))
    renamed = {f: _Renamed(h, text_disk) for f, h in handles.items()}
    return loader._read_all(cfg.text, on_disk, renamed, per_expert, dtype, device, many)


def _read_encoder(kind, prefix, on_disk, shapes, disk_of, handles, dtype, device):
    if not on_disk:
        return None  # this checkpoint has no such encoder
    found = {n.removeprefix(prefix): t for n, t in on_disk.items()}
    missing = [prefix + n for n in shapes if n not in found]
    unexpected = [prefix + n for n in found if n not in shapes]
    if missing or unexpected:
        raise UnsupportedCheckpointError(
            f"{kind} encoder: {len(missing)} tensor(s) missing ({loader._listing(missing)}), "
            f"{len(unexpected)} unexpected ({loader._listing(unexpected)}); does vision_config/audio_config "
            "match the weights?"
        )
    bad = [
        f"{prefix}{n}: expected {shapes[n]}, got {t.shape}" for n, t in found.items() if t.shape != shapes[n]
    ]
    if bad:
        raise UnsupportedCheckpointError(f"{len(bad)} mis-shaped {kind} tensor(s): {loader._listing(bad)}")
    return {
        n: handles[t.file].get_tensor(disk_of[prefix + n]).to(device=device, dtype=dtype)
        for n, t in found.items()
    }


def shared_thinker_weights(cfg: OmniConfig, named_tensors, dtype: torch.dtype, device) -> ThinkerWeights:
    """Shared weights (a colocated trainer's thinker `named_parameters()`), checked like a
    checkpoint and kept as the given storage. Text names go through the Qwen3-MoE check
    (`loader.shared_state_dict`, which names them as `model.layers...`); an encoder whose
    tensors are all absent is absent, as for a checkpoint."""
    text, encoders = [], {VISION: {}, AUDIO: {}}
    for name, t in named_tensors:
        if name.startswith(TEXT):
            text.append(("model." + name.removeprefix(TEXT), t))
        elif name == "lm_head.weight":
            text.append((name, t))
        elif name.startswith((VISION, AUDIO)):
            prefix = VISION if name.startswith(VISION) else AUDIO
            encoders[prefix][name.removeprefix(prefix)] = t
        else:
            raise ValueError(f"shared weights: unexpected thinker tensor {name}")
    vision_shapes, audio_shapes = encoder_shapes(cfg)
    return ThinkerWeights(
        text=loader.shared_state_dict(cfg.text, text, dtype, device),
        vision=_shared_encoder("vision", VISION, encoders[VISION], vision_shapes, dtype, device),
        audio=_shared_encoder("audio", AUDIO, encoders[AUDIO], audio_shapes, dtype, device),
    )


def _shared_encoder(kind, prefix, found: dict, shapes: dict, dtype, device) -> dict[str, torch.Tensor] | None:
    if not found:
        return None
    missing = [prefix + n for n in shapes if n not in found]
    unexpected = [prefix + n for n in found if n not in shapes]
    bad = [
        f"{prefix}{n}: expected {shapes[n]}, got {tuple(t.shape)}"
        for n, t in found.items()
        if n in shapes and tuple(t.shape) != shapes[n]
    ]
    if missing or unexpected or bad:
        raise ValueError(
            f"shared weights: {kind} encoder: missing {loader._listing(missing)}, unexpected "
            f"{loader._listing(unexpected)}, mis-shaped {loader._listing(bad)}"
        )
    want = torch.device(device)
    for name, t in found.items():
        if not isinstance(t, torch.Tensor) or t.is_meta or t.layout != torch.strided or not t.is_contiguous():
            raise ValueError(
                f"shared weights: {prefix}{name} must be a plain, dense, contiguous tensor with data"
            )
        if t.dtype != dtype:
            raise ValueError(f"shared weights: {prefix}{name} is {t.dtype}, but the engine runs {dtype}")
        if t.device.type != want.type or (want.index is not None and t.device.index != want.index):
            raise ValueError(f"shared weights: {prefix}{name} is on {t.device}, but the engine runs on {want}")
    return {name: t.detach() for name, t in found.items()}
