"""A byte-level BPE tokenizer over the tiny model's 384 ids, built offline with `tokenizers`.

ids 0-3 are special (<|bos|>, <|eos|>, <|im_start|>, <|im_end|>), 4-259 the 256 bytes,
260-383 merges of common ASCII letter pairs; a ChatML chat template. Any text encodes
(bytes are the fallback) and any id decodes, so random weights still yield text, and
multi-byte characters span several tokens (what incremental detokenization must handle).
"""

from __future__ import annotations

import shutil
from pathlib import Path

SPECIALS = ("<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_LETTERS = "etaoinshrdlucmfwypvbgkjqxz"


def build_tiny_tokenizer(vocab_size: int = 384):
    """A transformers `PreTrainedTokenizerFast` with exactly `vocab_size` ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(ByteLevel.alphabet(), key=_byte_of)  # the 256 byte symbols, in byte order
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    vocab.update({c: len(SPECIALS) + b for b, c in enumerate(alphabet)})
    merges = []
    pairs = ((a, b) for a in _LETTERS for b in _LETTERS)
    while len(vocab) < vocab_size:
        a, b = next(pairs)
        merges.append((a, b))
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[1])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _byte_of(symbol: str) -> int:
    """The byte a ByteLevel alphabet symbol stands for (GPT-2's printable remapping)."""
    o = ord(symbol)
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    if o in printable:
        return o
    rest = [b for b in range(256) if b not in printable]
    return rest[o - 256]


def add_tiny_tokenizer(path: str | Path) -> Path:
    """Save the tiny tokenizer (tokenizer.json, tokenizer_config.json) into a checkpoint dir."""
    build_tiny_tokenizer().save_pretrained(path)
    return Path(path)


def tiny_checkpoint_with_tokenizer(seed: int = 0) -> Path:
    """The cached tiny checkpoint plus the tiny tokenizer, in a sibling cache folder, built once."""
    from samebits.model.qwen3_moe.tiny import build_atomically, tiny_checkpoint_cache

    base = tiny_checkpoint_cache(seed=seed)
    final = base.parent / f"{base.name}-tokenizer"
    if (final / "tokenizer.json").is_file():
        return final

    def build(tmp: Path) -> None:
        shutil.copytree(base, tmp, dirs_exist_ok=True)
        add_tiny_tokenizer(tmp)

    return build_atomically(final, build)
