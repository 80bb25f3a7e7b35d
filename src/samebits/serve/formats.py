"""JSON shapes of the responses: OpenAI completions and chat (whole and streamed), SGLang /generate.

Log-probs are the engine's float32 values as Python floats: JSON writes a float's shortest
round-trip repr, so a client that reads the number back and casts it to float32 gets the
same bits. Only non-finite values (a top alternative with probability 0) become -9999.0,
as vLLM writes them, since JSON has no -Infinity.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from samebits.engine.outputs import CompletionOutput, RequestOutput


def finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


class TokenText:
    """Each token's own text: its decode, or `token_id:<id>` without a tokenizer (vLLM's form)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])


@dataclass
class Ctx:
    """What shapes one OpenAI response: token texts, top-k (None: no log-probs), whether
    choices carry token ids (vLLM's `return_token_ids`)."""

    tok: TokenText
    logprobs: int | None
    return_token_ids: bool
    # each request's `prompt_logprobs` JSON, built once for its n choices (id of its list -> JSON)
    prompt_json: dict = field(default_factory=dict)


def _with_ids(choice: dict, request: RequestOutput, out: CompletionOutput, part: slice, ctx: Ctx) -> dict:
    """Add the generated ids, and the prompt ids in a sample's first piece."""
    if ctx.return_token_ids:
        choice["token_ids"] = out.token_ids[part]
        if part.start == 0:
            choice["prompt_token_ids"] = request.prompt_token_ids
    if out.num_kept is not None and ctx.logprobs is not None:  # samebits': the processed modes' support
        choice["num_kept"] = out.num_kept[part]
    return choice


def prompt_logprobs(request: RequestOutput, tok: TokenText) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then per position
    {"<token id>": {"logprob", "rank", "decoded_token"}}, the prompt token first."""
    return [
        None
        if entry is None
        else {
            str(t): {"logprob": finite(e.logprob), "rank": e.rank, "decoded_token": tok(t)}
            for t, e in entry.items()
        }
        for entry in request.prompt_logprobs
    ]


@dataclass
class SampleCursor:
    """How much of one sample a stream has already sent."""

    tokens: int = 0
    text: int = 0
    done: bool = False


@dataclass
class StreamState:
    cursors: dict[tuple[int, int], SampleCursor] = field(default_factory=dict)

    def new_part(self, i: int, out: CompletionOutput) -> tuple[slice, str, bool] | None:
        """(new token slice, new text, finished now) of prompt i's sample, or None if nothing new."""
        c = self.cursors.setdefault((i, out.index), SampleCursor())
        if c.done:
            return None
        part = slice(c.tokens, len(out.token_ids))
        text = out.text[c.text :]
        finished = out.finish_reason is not None
        if part.start == part.stop and not text and not finished:
            return None
        c.tokens, c.text, c.done = part.stop, len(out.text), finished
        return part, text, finished


# -- OpenAI completions ---------------------------------------------------------------------


def completion_logprobs(out: CompletionOutput, part: slice, tok: TokenText, k: int) -> dict:
    """vLLM's shape: each position's `top_logprobs` holds the sampled token first, then the k
    most likely (k+1 entries, or k when the sampled token is one of them; `logprobs: 0` gives
    the sampled token alone). Its value is the same row's, so the two entries agree."""
    ids = out.token_ids[part]
    lps = [finite(v) for v in out.logprobs[part].tolist()]
    rows = out.top_logprobs[part] if k else [() for _ in ids]
    top = [_top_with_sampled(tok, t, v, row) for t, v, row in zip(ids, lps, rows, strict=True)]
    return {"tokens": [tok(t) for t in ids], "token_logprobs": lps, "top_logprobs": top, "text_offset": None}


def completion_choice(
    index: int, request: RequestOutput, out: CompletionOutput, part: slice, text: str, finished: bool, ctx: Ctx
) -> dict:
    """One completions choice (whole) or piece of one (streamed): tokens `part` of sample `out`."""
    choice = {
        "index": index,
        "text": text,
        "logprobs": None if ctx.logprobs is None else completion_logprobs(out, part, ctx.tok, ctx.logprobs),
        "finish_reason": out.finish_reason if finished else None,
    }
    if request.prompt_logprobs is not None and part.start == 0:  # (a stream's first piece)
        key = id(request.prompt_logprobs)
        if key not in ctx.prompt_json:
            ctx.prompt_json[key] = prompt_logprobs(request, ctx.tok)
        choice["prompt_logprobs"] = ctx.prompt_json[key]
    return _with_ids(choice, request, out, part, ctx)


def _top_with_sampled(tok: TokenText, t: int, v: float, row) -> dict:
    top = {tok(t): v}
    for a, b in row:  # a text two tokens share keeps the sampled token's value
        top.setdefault(tok(a), finite(b))
    return top


# -- OpenAI chat ----------------------------------------------------------------------------


def _chat_entry(tok: TokenText, t: int, v: float) -> dict:
    s = tok(t)
    return {"token": s, "logprob": finite(v), "bytes": list(s.encode())}


def chat_logprobs(out: CompletionOutput, part: slice, tok: TokenText, k: int) -> dict:
    rows = out.top_logprobs[part] if k else [[] for _ in out.token_ids[part]]
    content = []
    for t, v, row in zip(out.token_ids[part], out.logprobs[part].tolist(), rows, strict=True):
        entry = _chat_entry(tok, t, v)
        entry["top_logprobs"] = [_chat_entry(tok, a, b) for a, b in row]
        content.append(entry)
    return {"content": content}


def chat_choice(
    request: RequestOutput, out: CompletionOutput, part: slice, text: str, finished: bool, ctx: Ctx, delta: bool
) -> dict:
    """One chat choice (`message`) or streamed piece of one (`delta`, with the role first)."""
    key, message = ("delta", {"content": text}) if delta else ("message", {"content": text})
    if not delta or part.start == 0:
        message["role"] = "assistant"
    choice = {
        "index": out.index,
        key: message,
        "logprobs": None if ctx.logprobs is None else chat_logprobs(out, part, ctx.tok, ctx.logprobs),
        "finish_reason": out.finish_reason if finished else None,
    }
    return _with_ids(choice, request, out, part, ctx)


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# -- SGLang /generate -----------------------------------------------------------------------


def sglang_finish_reason(out: CompletionOutput) -> dict | None:
    if out.finish_reason is None:
        return None
    reason = {"type": out.finish_reason}
    if out.finish_reason == "length":
        reason["length"] = len(out.token_ids)
    return reason


def sglang_output(
    request: RequestOutput, out: CompletionOutput, return_logprob: bool, k: int, inputs: dict | None = None
) -> dict:
    """One sample of SGLang's /generate response. `inputs`: the prompt's scores
    (`sglang_input_logprobs`, built once for the n samples), or None."""
    meta = {
        "id": request.request_id,
        "finish_reason": sglang_finish_reason(out),
        "prompt_tokens": len(request.prompt_token_ids),
        "completion_tokens": len(out.token_ids),
    }
    if request.weight_version is not None:
        meta["weight_version"] = request.weight_version
    if return_logprob:
        meta["output_token_logprobs"] = [
            [finite(v), t, None] for v, t in zip(out.logprobs.tolist(), out.token_ids, strict=True)
        ]
        if k:
            meta["output_top_logprobs"] = [[[finite(v), t, None] for t, v in row] for row in out.top_logprobs]
        if out.num_kept is not None:  # samebits': the processed modes' support, per token
            meta["output_token_num_kept"] = list(out.num_kept)
        if inputs is not None:
            meta |= inputs
    result = {"text": out.text, "output_ids": list(out.token_ids), "meta_info": meta}
    if len(request.outputs) > 1:
        result["index"] = out.index
    return result


def sglang_input_logprobs(request: RequestOutput, start: int, k: int) -> dict:
    """SGLang's prompt scores from position `start` (< the prompt's length): `input_token_logprobs`
    [[logprob, id, null]] per position and, with k, `input_top_logprobs` (the k most likely per
    position, best first). As SGLang answers, the first position's value and list are null
    (SGLang computes the logits from `start` on, which score the tokens after it)."""
    ids, tokens, tops = request.prompt_token_ids, [], []
    for p in range(start, len(ids)):
        entry = request.prompt_logprobs[p]
        if entry is None or p == start:
            tokens.append([None, ids[p], None])
            tops.append(None)
            continue
        tokens.append([finite(entry[ids[p]].logprob), ids[p], None])
        # the top k are the entries ranked <= k, less the prompt token where it is listed beside
        # them (k + 1 entries: `prompt_logprobs.as_logprobs`)
        top = [(t, e) for t, e in entry.items() if not (t == ids[p] and len(entry) > k)]
        tops.append([[finite(e.logprob), t, None] for t, e in sorted(top, key=lambda te: te[1].rank)])
    out = {"input_token_logprobs": tokens}
    if k:
        out["input_top_logprobs"] = tops
    return out


def sglang_scores_only(request: RequestOutput) -> RequestOutput:
    """The request as SGLang answers `max_new_tokens: 0`: every sample without tokens, finished
    by length 0 (the engine's one sampled token left out)."""
    outs = [
        dataclasses.replace(
            c,
            token_ids=[],
            finish_reason=c.finish_reason if c.finish_reason in (None, "abort") else "length",
            logprobs=c.logprobs[:0],
            text="",
            top_logprobs=None if c.top_logprobs is None else [],
            num_kept=None if c.num_kept is None else [],
        )
        for c in request.outputs
    ]
    first = outs[0]
    return dataclasses.replace(
        request, outputs=outs, token_ids=[], logprobs=first.logprobs, text="", finish_reason=first.finish_reason
    )
