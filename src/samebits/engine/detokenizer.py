"""Text out of token ids, one token at a time; stop strings; chat prompts.

Pure Python over a transformers tokenizer. A token may end in the middle of a multi-byte
character: its bytes decode to U+FFFD until the rest arrive, so text is only released
once the decoded tail no longer ends in U+FFFD (the prefix/read-offset scheme: decode a
short window of recent ids and keep what it adds beyond the window's known prefix).
"""

from __future__ import annotations

from pathlib import Path

_CONTEXT = 5  # prompt ids decoded in front of the output, so a leading space renders as it will
_REPLACEMENT = "\ufffd"


def load_tokenizer(path: str | Path):
    """The checkpoint directory's tokenizer (AutoTokenizer), or None when it has none."""
    path = Path(path)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template's prompt ids for `messages`, ending with the assistant's turn opened
    (`apply_chat_template(add_generation_prompt=True)`). ValueError when there is no template."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: the checkpoint's tokenizer has no chat_template; send a prompt instead")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return [int(t) for t in ids]


class IncrementalDetokenizer:
    """One sample's text, grown one token at a time.

    `text` is what may be shown so far: with stop strings, the last `max(len(stop)) - 1`
    characters are held back until the sample finishes (they may begin a stop string that
    is then trimmed), so streamed text never has to be taken back.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...] | None = None):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-_CONTEXT:])
        self.prefix = 0  # ids[prefix:read] decode to text already released
        self.read = len(self.ids)
        self.stop = stop or ()
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._text = ""
        self.stopped: str | None = None  # the stop string found, if any
        self.finished = False

    @property
    def text(self) -> str:
        if self.finished or not self._hold:
            return self._text
        return self._text[: max(0, len(self._text) - self._hold)]

    def add(self, token_id: int) -> None:
        """Append one sampled token; sets `stopped` when the text now contains a stop string."""
        if self.stopped is not None or self.finished:
            return
        self.ids.append(token_id)
        new = self._decode_tail(final=False)
        if new:
            self._grow(new)

    def finish(self) -> None:
        """Release the held-back text and any bytes that never completed a character."""
        if self.finished:
            return
        if self.stopped is None:
            new = self._decode_tail(final=True)
            if new:
                self._grow(new)
        self.finished = True

    def _decode_tail(self, final: bool) -> str:
        decode = self.tokenizer.decode
        known = decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        full = decode(self.ids[self.prefix :], skip_special_tokens=True)
        if len(full) <= len(known) or (full.endswith(_REPLACEMENT) and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return full[len(known) :]

    def _grow(self, new: str) -> None:
        start = max(0, len(self._text) - self._hold)  # a stop string may straddle old and new text
        self._text += new
        hits = [(i, s) for s in self.stop if (i := self._text.find(s, start)) != -1]
        if hits:
            pos, s = min(hits)
            self._text = self._text[:pos]
            self.stopped = s
