"""Reading a checkpoint's `config.json` and `generation_config.json` through transformers
(`AutoConfig`, `GenerationConfig`); every refusal names the file and the field."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path


class UnsupportedCheckpointError(ValueError):
    """The checkpoint is not one samebits can run; the message says why and what to do."""


def read_config_json(path: str | Path) -> dict:
    """`path/config.json` as a dict; a missing file, bad JSON or a non-object is refused by name."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise UnsupportedCheckpointError(
            f"{file}: missing; pass a Hugging Face checkpoint directory (config.json and *.safetensors)"
        )
    return read_json(file)


def read_json(file: Path) -> dict:
    """A JSON object from `file`; bad JSON, non-UTF-8 text or a non-object is refused by name."""
    try:
        d = json.loads(file.read_bytes())
    except json.JSONDecodeError as e:
        raise UnsupportedCheckpointError(
            f"{file}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); fix or re-download it"
        ) from None
    except UnicodeDecodeError as e:
        raise UnsupportedCheckpointError(f"{file}: not UTF-8 text ({e.reason}); re-download it") from None
    if not isinstance(d, dict):
        raise UnsupportedCheckpointError(f"{file}: holds a JSON {type(d).__name__}, expected an object")
    return d


def auto_config(path: str | Path):
    """transformers' `AutoConfig.from_pretrained(path)`; its own refusals re-raised naming the file."""
    from transformers import AutoConfig

    with _transformers_refusal(Path(path) / "config.json"):
        return AutoConfig.from_pretrained(str(path), local_files_only=True)


def hf_config(d: dict, model_type: str):
    """transformers' config object for an in-memory dict (`AutoConfig.for_model`)."""
    from transformers import AutoConfig

    with _transformers_refusal("config dict"):
        return AutoConfig.for_model(model_type, **{k: v for k, v in d.items() if k != "model_type"})


def generation_eos(path: str | Path, config_eos, vocab_size: int) -> tuple[int, ...]:
    """The eos ids a request stops at: `generation_config.json`'s eos_token_id (int or list,
    read by transformers' `GenerationConfig.from_pretrained`) when that file exists, as
    transformers' `generate` does; else `config_eos` (config.json's)."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return eos_ids(config_eos)
    from transformers import GenerationConfig

    read_json(file)  # bad JSON refused with its position; transformers' OSError would not say where
    with _transformers_refusal(file):
        gen = GenerationConfig.from_pretrained(str(path), local_files_only=True)
    with named(file):
        eos = eos_ids(gen.eos_token_id)
        if is_int(vocab_size) and vocab_size > 0:  # else config.json's vocab_size is refused by name
            check_eos(eos, vocab_size)
    return eos


def eos_ids(value) -> tuple[int, ...]:
    """eos_token_id (None, int or list of int) as a tuple."""
    ids = () if value is None else tuple(value) if isinstance(value, list | tuple) else (value,)
    if not all(is_int(i) for i in ids):
        raise UnsupportedCheckpointError(f"eos_token_id {value!r} must be an integer or a list of integers")
    return ids


@contextlib.contextmanager
def named(where):
    """Prefix UnsupportedCheckpointErrors raised inside with the file (or other source) they are about."""
    try:
        yield
    except UnsupportedCheckpointError as e:
        raise UnsupportedCheckpointError(f"{where}: {e}") from None


@contextlib.contextmanager
def _transformers_refusal(where):
    """transformers' own config validation (strict types, rope keys, ...) names no file: add it."""
    try:
        yield
    except UnsupportedCheckpointError:
        raise
    except Exception as e:  # StrictDataclassFieldValidationError, KeyError, ValueError, OSError, ...
        msg = " ".join(str(e).split())
        raise UnsupportedCheckpointError(
            f"{where}: transformers refused it ({type(e).__name__}: {msg}); fix the field it names"
        ) from e


def check_eos(eos: tuple[int, ...], vocab_size: int) -> None:
    """Refuse an eos id the model cannot produce (a request would never stop there)."""
    bad = [i for i in eos if not (is_int(i) and 0 <= i < vocab_size)]
    if bad:
        raise UnsupportedCheckpointError(
            f"eos_token_id {bad} outside the vocabulary [0, {vocab_size}); the model could never stop there"
        )


def is_int(v) -> bool:
    """An int that is not a bool (JSON true would pass isinstance(v, int))."""
    return isinstance(v, int) and not isinstance(v, bool)


def dtype_name(dtype) -> str:
    """config.json's dtype (a torch.dtype once transformers read it) as a name; bfloat16 if unset."""
    return "bfloat16" if dtype is None else str(dtype).removeprefix("torch.")
