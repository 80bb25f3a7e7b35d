"""The rollout-vs-trainer probe behind `samebits verify`.

Rollout: seq0 alone, and seq0..3 as concurrent requests. Trainer: the
transformers model with samebits experts and attention, one sequence per
forward and all packed into one forward, under `batch_invariant()`. Negative
controls switch one piece of the trainer back to stock transformers
(`grouped_mm` experts; `sdpa` attention) and must show mismatches: a check
that cannot fail proves nothing.

With a `logprob_formula` other than log_softmax (docs/logprobs.md), the engine reports that
framework's line and the trainer recomputes it; the control is the trainer on the formula's
neighbour line (`CONTROL_LINE`), which must mismatch on the same tokens.
"""

from __future__ import annotations

import contextlib
import gc
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from samebits.engine.llm import LLM
from samebits.numerics.batch_invariant import batch_invariant
from samebits.requests import SamplingParams

DEFAULT_PROMPT_LENS = (10, 16, 16, 24)
# each named formula's control: a neighbouring line whose bits differ from it (cross_entropy and
# log_softmax are the same bits, so neither is the other's control)
CONTROL_LINE = {
    "trl": "logsumexp",
    "trl_selective": "verl",
    "verl": "log_softmax",
    "logsumexp": "log_softmax",
    "cross_entropy": "logsumexp",
}


@dataclass
class ArmResult:
    arm: str
    seq: int
    exact: bool  # True: must be 0 mismatches; False: a negative control, must mismatch
    mismatches: int
    total: int
    first_mismatch: int | None
    max_abs_diff: float

    @property
    def passed(self) -> bool:
        return self.mismatches == 0 if self.exact else self.mismatches > 0


def compare(arm: str, seq: int, exact: bool, got: torch.Tensor, want: torch.Tensor) -> ArmResult:
    """Bitwise comparison of two float32 log-prob vectors (a length difference is a mismatch)."""
    got, want = got.detach().cpu(), want.detach().cpu()
    n = min(got.numel(), want.numel())
    differ = got[:n] != want[:n]
    idx = differ.nonzero()
    first = int(idx[0]) if idx.numel() else (n if got.numel() != want.numel() else None)
    mismatches = int(differ.sum()) + abs(got.numel() - want.numel())
    diff = float((got[:n] - want[:n]).abs().max()) if n else 0.0
    return ArmResult(arm, seq, exact, mismatches, max(got.numel(), want.numel()), first, diff)


def make_prompts(prompt_lens, vocab_size: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab_size, (n,), generator=g).tolist() for n in prompt_lens]


def other_device_rounding(temperature: float):
    """The trainer's line with `/ T` rounded as the *other* device rounds it: on CUDA a division
    by float32(T), on the CPU a multiplication by float32(1 / T). A control for the temperature
    claim: it differs from the line only in how 1 / T is rounded."""
    t = torch.tensor(temperature, dtype=torch.float32)

    def logprob_fn(rows: torch.Tensor) -> torch.Tensor:
        x = rows.float()
        scaled = x / t.to(x.device) if x.is_cuda else x * torch.reciprocal(t).to(x.device)
        return torch.log_softmax(scaled, dim=-1)

    return logprob_fn


def _trainer_logprobs(
    path, device, dtype, seqs, prompt_lens, packed, temperature, invariant=True, formula="log_softmax", **impl
):
    from samebits import trainer

    fn = impl.pop("logprob_fn", None)
    model = trainer.load_hf_model(path, device=device, dtype=dtype, **impl)
    try:
        with batch_invariant() if invariant else contextlib.nullcontext():
            lps = trainer.token_logprobs(
                model,
                seqs,
                prompt_lens,
                packed=packed,
                temperature=temperature,
                logprob_fn=fn,
                logprob_formula=formula,
            )
        return [lp.cpu() for lp in lps]
    finally:
        del model
        _free_device_memory()


def _free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(
    model: str | Path | None = None,
    device: str = "cpu",
    dtype: str = "bfloat16",
    tokens: int = 32,
    seed: int = 0,
    prompt_lens=DEFAULT_PROMPT_LENS,
    log=print,
    temperature: float = 1.0,
    logprob_formula: str = "log_softmax",
) -> list[ArmResult]:
    """Run the probe matrix at one sampling temperature; returns one ArmResult per (arm,
    sequence). At a temperature other than 0 and 1, one more control: the trainer's line with
    1 / T rounded as the other device rounds it (`other_device_rounding`). Another
    `logprob_formula`: the engine and the trainer both on that line, and one control, the
    trainer on `CONTROL_LINE[formula]`."""
    if logprob_formula != "log_softmax" and logprob_formula not in CONTROL_LINE:
        names = ["log_softmax", *sorted(CONTROL_LINE)]
        raise ValueError(f"logprob_formula must be one of {names}, got {logprob_formula!r}")
    if model is None:
        from samebits.model.qwen3_moe.tiny import tiny_checkpoint_cache

        model = tiny_checkpoint_cache(seed=seed)
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    max_len = max(prompt_lens) + tokens
    formula = logprob_formula
    llm = LLM(model, device=device, dtype=dtype, max_num_seqs=8, max_model_len=max_len, logprob_formula=formula)
    prompts = make_prompts(prompt_lens, llm.config.vocab_size, seed)
    params = [
        SamplingParams(
            temperature=temperature, top_p=1.0, top_k=-1, max_tokens=tokens, ignore_eos=True, seed=seed + i
        )
        for i in range(len(prompts))
    ]
    log(f"rollout: seq0 alone, then {len(prompts)} concurrent requests, {tokens} tokens each")
    t0 = time.perf_counter()
    alone = llm.generate(prompts[:1], params[:1])[0]
    t1 = time.perf_counter()
    batched = llm.generate(prompts, params)
    t2 = time.perf_counter()
    log(
        f"rollout wall time: alone {t1 - t0:.1f} s, batched {t2 - t1:.1f} s "
        f"({1000 * (t2 - t1) / tokens:.1f} ms per decode step incl. prefill)"
    )
    seqs = [o.prompt_token_ids + o.token_ids for o in batched]
    plens = [len(o.prompt_token_ids) for o in batched]
    rollout = [o.logprobs for o in batched]
    del llm  # the trainer models below need the memory (a 48-layer model is 61 GB)
    _free_device_memory()

    results = [compare("rollout alone vs batched", 0, True, alone.logprobs, rollout[0])]
    if alone.token_ids != batched[0].token_ids:
        results[-1].mismatches = max(results[-1].mismatches, 1)
    arms = [
        ("trainer one-at-a-time", True, False, {}),
        ("trainer packed", True, True, {}),
        # fp32 has no bf16 rounding for grouped_mm to differ in: there the control is the
        # trainer on stock GEMMs and reductions (no batch_invariant())
        ("NEG grouped_mm experts, packed", False, True, {"experts_implementation": "grouped_mm"})
        if dtype != "float32"
        else ("NEG stock kernels, packed", False, True, {"invariant": False}),
        ("NEG sdpa attention, packed", False, True, {"attn_implementation": "sdpa"}),
    ]
    if logprob_formula != "log_softmax":  # the line is the claim: its control is another line
        control = CONTROL_LINE[logprob_formula]
        arms = [
            (f"trainer one-at-a-time, {logprob_formula}", True, False, {}),
            (f"trainer packed, {logprob_formula}", True, True, {}),
            (f"NEG {control} line, packed", False, True, {"formula": control}),
        ]
    elif temperature not in (0.0, 1.0):
        fn = other_device_rounding(temperature)
        arms.append(("NEG 1/T as other device, packed", False, True, {"logprob_fn": fn}))
    for name, exact, packed, impl in arms:
        log(f"trainer: {name}")
        impl = {"formula": logprob_formula} | impl
        lps = _trainer_logprobs(model, device, torch_dtype, seqs, plens, packed, temperature, **impl)
        results += [compare(name, i, exact, lps[i], rollout[i]) for i in range(len(seqs))]
    return results


def passed(results: list[ArmResult]) -> bool:
    """Every exact arm 0 mismatches; every negative-control arm (summed over seqs) some."""
    exact_ok = all(r.mismatches == 0 for r in results if r.exact)
    neg_arms = {r.arm for r in results if not r.exact}
    neg_ok = all(sum(r.mismatches for r in results if r.arm == a) > 0 for a in neg_arms)
    return exact_ok and neg_ok


def print_table(results: list[ArmResult], console=None) -> None:
    """The results as a table that fits an 80-column pipe: no vertical rules, arm names never
    wrapped ("control": a negative control, which must mismatch)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    table.add_column("arm", no_wrap=True)
    for col in ("seq", "kind", "mismatches", "first", "max |diff|"):
        table.add_column(col, no_wrap=True)
    for r in results:
        table.add_row(
            r.arm,
            str(r.seq),
            "exact" if r.exact else "control",
            f"{r.mismatches}/{r.total}",
            "-" if r.first_mismatch is None else str(r.first_mismatch),
            f"{r.max_abs_diff:.3g}",
        )
    console = console or Console()
    console.print("samebits verify: rollout log-probs vs trainer recompute (torch.equal per token)")
    console.print(table)


def write_json(results: list[ArmResult], path: str | Path) -> None:
    doc = {"passed": passed(results), "arms": [asdict(r) | {"passed": r.passed} for r in results]}
    Path(path).write_text(json.dumps(doc, indent=2))
