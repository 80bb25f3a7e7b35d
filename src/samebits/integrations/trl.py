"""TRL's `GRPOTrainer` driving samebits: a `rollout_func`, and TRL's log-prob line made exact.

    import samebits
    from samebits import trainer as sb
    from samebits.integrations import trl as sbtrl

    model = sb.load_hf_model(path)                          # samebits experts + attention
    rollout = sbtrl.rollout_func(samebits.LLM(path))        # in this process, or a server's URL
    trainer = GRPOTrainer(model=model, args=args, ..., rollout_func=rollout)
    sbtrl.exact_logprobs(trainer)                           # TRL's recompute under batch_invariant()
    trainer.train()

The rollout reports each sampled token's log-prob by TRL 1.16's own line (`logprob_formula="trl"`:
the fused LM head `add_fused_lm_head` that `GRPOTrainer` computes its per-token log-probs with,
docs/logprobs.md), pushes the trainer's weights into the engine whenever
`trainer.state.global_step` has moved since its last push (digests compared after each push),
and returns TRL's `prompt_ids`, `completion_ids` and `logprobs`. `exact_logprobs` wraps
`GRPOTrainer._get_per_token_logps_and_entropies` (TRL's one place that computes log-probs: old,
reference and training forwards) in `samebits.batch_invariant()`, packs rows TRL padded into one
row with positions restarting at 0 (samebits attention takes no padding mask), and logs, per
generation batch, TRL's mismatch metrics `sampling/sampling_logp_difference/{mean,max}` and
`sampling/importance_sampling_ratio/{min,mean,max}` (which TRL itself logs only with vLLM) plus
`samebits/logprob_mismatch_count` and `samebits/logprob_tokens` (bitwise).

Tested with TRL 1.16.0 (docs/integrations.md says what is and is not supported).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from samebits.engine.llm import LLM
from samebits.integrations.backends import LocalEngine, ServerEngine, engine_for
from samebits.numerics.batch_invariant import batch_invariant
from samebits.requests import SamplingParams
from samebits.trainer import checkpoint_context

FORMULA = "trl"  # TRL 1.16's ChunkedLogProbFunction line (numerics/logprob_formulas.py)
_MARK = "_samebits_exact_logprobs"
METRICS = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
    "samebits/logprob_mismatch_count",
    "samebits/logprob_tokens",
)


class SamebitsRollout:
    """A `rollout_func` for `GRPOTrainer`: `rollout(prompts, trainer) -> dict` (see the module
    docstring). `engine`: `backends.LocalEngine` or `backends.ServerEngine`. `syncs` lists each
    push: (global_step, number of tensors)."""

    def __init__(
        self,
        engine: LocalEngine | ServerEngine,
        *,
        seed: int | None = None,
        ignore_eos: bool = False,
        check_digests: bool = True,
        logprob_formula: str = FORMULA,
    ):
        if seed is not None and not (isinstance(seed, int) and 0 <= seed < 2**62):
            raise ValueError(f"seed must be None or an int in [0, 2**62), got {seed!r}")
        if not isinstance(logprob_formula, str):
            raise ValueError(f"logprob_formula must be a formula name, got {logprob_formula!r}")
        SamplingParams(logprob_formula=logprob_formula)  # an unknown name is refused here
        self.engine, self.seed, self.ignore_eos = engine, seed, ignore_eos
        self.check_digests, self.logprob_formula = check_digests, logprob_formula
        self.synced_step: int | None = None
        self.syncs: list[tuple[int, int]] = []
        self._calls = 0

    def __call__(self, prompts: list, trainer) -> dict[str, list]:
        if self._calls == 0:
            check_trainer(trainer)
        self._calls += 1
        step = trainer.state.global_step
        if step != self.synced_step:
            self.sync(trainer)
        prompt_ids, images, _ = trainer._tokenize_prompts(prompts)  # TRL's own templating
        if images is not None:
            raise NotImplementedError("samebits' TRL rollout takes text prompts only, got images")
        prompt_ids = [list(p) for p in prompt_ids]
        params = [self._params(trainer, step, i) for i in range(len(prompt_ids))]
        outs = self.engine.generate(prompt_ids, params)
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": [ids for ids, _ in outs],
            "logprobs": [lps for _, lps in outs],
        }

    def _params(self, trainer, step: int, i: int) -> SamplingParams:
        seed = None if self.seed is None else (self.seed * 1_000_003 + step * 65_537 + self._calls * 257 + i)
        stops = None if self.ignore_eos else tuple(int(t) for t in trainer.eos_token_ids if t is not None)
        return SamplingParams(
            temperature=float(trainer.temperature),
            top_p=float(trainer.top_p),
            top_k=-1 if not trainer.top_k else int(trainer.top_k),  # TRL: 0 or None is off
            max_tokens=int(trainer.max_completion_length),
            ignore_eos=self.ignore_eos,
            stop_token_ids=stops,
            seed=None if seed is None else seed % 2**63,
            detokenize=False,
            logprob_formula=self.logprob_formula,
        )

    def sync(self, trainer) -> None:
        """Push every trainer parameter into the engine; with `check_digests`, RuntimeError
        unless the engine's digests then equal the trainer's (cast to the engine's dtype)."""
        model = trainer.accelerator.unwrap_model(trainer.model)
        pairs = [(n, p.detach()) for n, p in model.named_parameters()]
        self.engine.push(pairs)
        if self.check_digests and (bad := self.engine.mismatched(pairs)):
            raise RuntimeError(
                f"after the weight push at step {trainer.state.global_step} the engine's {len(bad)} "
                f"tensors differ from the trainer's, e.g. {bad[:3]}"
            )
        self.synced_step = trainer.state.global_step
        self.syncs.append((self.synced_step, len(pairs)))

    def close(self) -> None:
        """Leave the server's weight-update group (nothing to do for an in-process LLM)."""
        if isinstance(self.engine, ServerEngine):
            self.engine.close()


def rollout_func(
    llm_or_url: LLM | str,
    *,
    api_key: str | None = None,
    group_address: str = "127.0.0.1",
    group_port: int | None = None,
    **kwargs,
) -> SamebitsRollout:
    """`GRPOTrainer(..., rollout_func=rollout_func(samebits.LLM(path)))`, or with the URL of a
    `samebits serve` (`api_key`: its admin key; the weight-update group listens on this process's
    `group_address:group_port`, None a free port). Keywords: `seed` (the requests' seeds are
    derived from it, the step and the index; None: the engine draws), `ignore_eos` (every
    completion `max_completion_length` tokens), `check_digests` (compare every tensor's sha256
    after each push, default True), `logprob_formula` (default "trl", TRL's line; any other is for
    controls: TRL's recompute then differs)."""
    if isinstance(llm_or_url, LLM):
        engine = engine_for(llm_or_url)
    else:
        engine = engine_for(llm_or_url, api_key=api_key, group_address=group_address, group_port=group_port)
    return SamebitsRollout(engine, **kwargs)


def check_trainer(trainer) -> None:
    """ValueError naming what to change when `trainer` is set up in a way this integration
    cannot make exact (run by `exact_logprobs`, again on the rollout's first call)."""
    if not getattr(trainer, _MARK, False):
        raise ValueError(
            "the trainer's log-probs are not computed under batch_invariant(): call "
            "samebits.integrations.trl.exact_logprobs(trainer) after building GRPOTrainer"
        )
    _check_args(trainer)


def _check_args(trainer) -> None:
    args = trainer.args
    if args.use_vllm:
        raise ValueError("use_vllm=True: samebits generates the rollouts here; set use_vllm=False")
    if args.cast_lm_head_to_fp32:
        raise ValueError("cast_lm_head_to_fp32=True: TRL's line is the bf16 projection; set it False")
    for field, off in (("min_p", None), ("repetition_penalty", 1.0), ("generation_kwargs", None)):
        value = getattr(args, field)
        if value != off and not (field == "generation_kwargs" and value == {}):
            raise ValueError(f"GRPOConfig.{field}={value!r} is not supported by samebits' rollout; set {off}")
    if trainer.tools or getattr(trainer, "environment_factories", None):
        raise ValueError("tools / environment_factory are not supported by samebits' rollout_func")
    if trainer.temperature <= 0:
        raise ValueError(f"GRPOConfig.temperature must be > 0, got {trainer.temperature}")


def exact_logprobs(trainer, metrics: bool = True):
    """Make `trainer` (a `trl.GRPOTrainer`) compute its per-token log-probs with the engine's
    bits: its model must run samebits' experts and attention (`samebits.trainer.load_hf_model`),
    and its `_get_per_token_logps_and_entropies` is wrapped in `batch_invariant()`; padded rows
    are packed (module docstring). `metrics`: log the mismatch metrics per generation batch
    (an extra no-grad recompute where TRL computes no old log-probs itself). Returns `trainer`."""
    if getattr(trainer, _MARK, False):
        return trainer
    model = trainer.accelerator.unwrap_model(trainer.model)
    if hasattr(model, "peft_config"):
        raise ValueError("PEFT models are not supported: the engine takes the full model's weights")
    config = model.config.get_text_config()
    impls = (config._attn_implementation, getattr(config, "_experts_implementation", "samebits"))
    if impls != ("samebits", "samebits"):
        raise ValueError(
            f"the trainer's model runs attention {impls[0]!r} and experts {impls[1]!r}: load it with "
            "samebits.trainer.load_hf_model(path) (or from_pretrained(..., attn_implementation='samebits', "
            "experts_implementation='samebits')) and pass that model to GRPOTrainer"
        )
    _check_args(trainer)
    _checkpoint_in_context(trainer.args)
    trl_logps = trainer._get_per_token_logps_and_entropies  # bound: TRL's own method
    trainer._get_per_token_logps_and_entropies = functools.partial(_exact, trainer, trl_logps)
    if metrics:
        generate = trainer._generate_and_score_completions
        trainer._generate_and_score_completions = functools.partial(_scored, trainer, generate)
    setattr(trainer, _MARK, True)
    return trainer


def _checkpoint_in_context(args) -> None:
    """Activation checkpointing (GRPOConfig's default) recomputes each layer in backward,
    outside `batch_invariant()`: non-reentrant checkpointing with samebits' `checkpoint_context`
    re-enters the forward's numerics there (docs/design.md); reentrant takes no context."""
    # transformers >= 5.2x names it activation_checkpointing; before, gradient_checkpointing only
    on = getattr(args, "activation_checkpointing", None)
    on = args.gradient_checkpointing if on is None else on
    if not on:
        return
    given = getattr(args, "activation_checkpointing_kwargs", None) or args.gradient_checkpointing_kwargs
    kwargs = dict(given or {})
    if kwargs.get("use_reentrant"):
        raise ValueError(
            "activation checkpointing with use_reentrant=True cannot re-enter batch_invariant() in "
            "its recompute: set activation_checkpointing_kwargs={'use_reentrant': False}, or turn it off"
        )
    kwargs |= {"use_reentrant": False, "context_fn": checkpoint_context}
    args.activation_checkpointing_kwargs = args.gradient_checkpointing_kwargs = kwargs


def _exact(trainer, trl_logps, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
    """TRL's log-probs under batch_invariant(); rows with padding are packed first."""
    with batch_invariant():
        if bool(attention_mask.all()):
            return trl_logps(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        return _packed(trainer, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)


def _packed(
    trainer, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
    compute_aux_loss=False, **multimodal,
):  # fmt: skip
    """`_get_per_token_logps_and_entropies` for padded text rows: each chunk of `batch_size`
    rows [B, S] becomes one row of its N unpadded tokens with positions restarting at 0, through
    the same fused-LM-head forward; results are put back at their [B, S] places (0 at padding)."""
    if any(v is not None for v in multimodal.values()):
        raise NotImplementedError(f"padded multimodal rows are not supported ({sorted(multimodal)})")
    logps, entropies, aux = [], [], []
    step = batch_size or input_ids.size(0)
    for start in range(0, input_ids.size(0), step):
        ids, keep = input_ids[start : start + step], attention_mask[start : start + step].bool()
        labels = ids.masked_fill(~keep, -100)
        labels[:, :-logits_to_keep] = -100
        lens = keep.sum(1).tolist()
        positions = torch.cat([torch.arange(n, device=ids.device) for n in lens]).unsqueeze(0)  # [1, N]
        extra = {"output_router_logits": True} if compute_aux_loss else {}
        with trainer.accelerator.autocast():
            out = model(
                input_ids=ids[keep].unsqueeze(0),
                position_ids=positions,
                labels=labels[keep].unsqueeze(0),
                fused_lm_head=True,
                **extra,
            )
        logps.append(_unpack(out.log_probs, keep, logits_to_keep))
        if compute_entropy:
            entropies.append(_unpack(out.entropy, keep, logits_to_keep))
        if compute_aux_loss:
            aux.append(out.aux_loss)
    return (
        torch.cat(logps),
        torch.cat(entropies) if compute_entropy else None,
        torch.stack(aux).mean() if compute_aux_loss else None,
    )


def _unpack(x: torch.Tensor, keep: torch.Tensor, k: int) -> torch.Tensor:
    """x [1, N-1] (the value of packed token j+1) -> [B, k]: the value of each row's token at its
    padded position, the last k columns (TRL's layout), 0 at padding."""
    values = torch.cat([x.new_zeros(1), x[0]])  # [N]: token j's value (token 0 has none)
    return x.new_zeros(keep.shape).masked_scatter(keep, values)[:, -k:]


def _scored(trainer, generate, inputs):
    """TRL's `_generate_and_score_completions`, then the mismatch metrics of its batch."""
    out = generate(inputs)
    sampled = out.get("sampling_per_token_logps")
    if sampled is None:
        return out
    old = out.get("old_per_token_logps")
    if old is None:  # TRL computes none for on-policy batches: recompute with its own method
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        size = trainer.args.per_device_train_batch_size if trainer.model.training else None
        with torch.no_grad():
            old, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, mask, out["completion_ids"].size(1), batch_size=size
            )
    mask = out["completion_mask"].bool()
    if out.get("tool_mask") is not None:
        mask &= out["tool_mask"].bool()
    mode = "train" if trainer.model.training else "eval"
    for name, value in zip(METRICS, mismatch_metrics(old, sampled, mask), strict=True):
        trainer._metrics[mode][name].append(value)
    return out


def mismatch_metrics(old: torch.Tensor, sampled: torch.Tensor, mask: torch.Tensor) -> Sequence[float]:
    """The values of `METRICS` for [B, T] recomputed and rollout log-probs over `mask`: the
    absolute difference's mean and max, exp(old - sampled)'s min, mean and max (TRL's
    token-level ratio before clipping), the count of tokens whose bits differ, the tokens."""
    old, sampled = old[mask].float(), sampled[mask].float()
    if old.numel() == 0:
        return (0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0)
    delta, ratio = (old - sampled).abs(), torch.exp(old - sampled)
    differ = int((old.view(torch.int32) != sampled.view(torch.int32)).sum())
    return (
        delta.mean().item(),
        delta.max().item(),
        ratio.min().item(),
        ratio.mean().item(),
        ratio.max().item(),
        float(differ),
        float(old.numel()),
    )
