"""`samebits.LLM`: the front door. Validates requests, drives schedule -> run -> postprocess.

Its limits are an `EngineConfig` (engine/config.py); the requests in flight are the
`EngineCore`'s (engine/core.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch

from samebits.engine.block_manager import BlockManager
from samebits.engine.config import EngineConfig
from samebits.engine.core import EngineCore, exclusive
from samebits.engine.outputs import RequestOutput
from samebits.engine.runner import ModelRunner
from samebits.engine.sampler import SampleRequest
from samebits.engine.scheduler import Scheduler
from samebits.engine.sequence import Sequence as Seq
from samebits.engine.validation import check_request, no_tokenizer
from samebits.engine.weight_files import load_from_disk
from samebits.engine.weight_store import WeightStore
from samebits.model.families import family_for
from samebits.model.hub import resolve_model_path
from samebits.numerics import logprob_formulas
from samebits.numerics.profile import PROFILES
from samebits.progress import GenerateProgress
from samebits.requests import FusedLine, SamplingParams
from samebits.requests.sampling_params import logprobs_mode_problem


class LLM:
    """A rollout engine over a local HF checkpoint directory of a model family in `model/families.py`.

    >>> llm = LLM("ckpt", device="cpu", dtype="bfloat16", max_num_seqs=8)
    >>> outs = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, seed=0))
    """

    def __init__(
        self, model: str | Path, *, weights: Iterable[tuple[str, torch.Tensor]] | None = None, **engine_kwargs
    ):
        """`model`: the checkpoint directory (config and, unless `weights` is given, weights),
        or a hub id ("Qwen/Qwen3-30B-A3B") already in the local Hugging Face cache.

        `weights`: (HF name, tensor) pairs the engine takes as its parameters instead of
        reading the checkpoint's, sharing their storage (no copy): a trainer colocated on the
        same device passes its own parameters, so one copy of the model serves both and every
        optimizer step is in the engine at once. Names and shapes are checked against the
        config; each tensor must be contiguous, of the engine's dtype and on its device. After
        changing them in place, call `reset_prefix_cache()` (or `sleep()`, which does) before
        generating again: cached prompt K/V are the old weights'.
        """
        self.engine = EngineConfig(**engine_kwargs)
        self.path = resolve_model_path(model)  # a directory, or a hub id's cached snapshot
        self.family = family_for(self.path).load(  # the only thing that knows the model (model/family.py)
            self.path,
            dtype=self.engine.torch_dtype,
            device=self.engine.device,
            weights=weights,
        )
        self.config, self.model = self.family.config, self.family.model
        self._row_invariant: set[Callable | FusedLine] = set()  # the users' row functions checked so far
        self._check_line(self.engine.logprob_formula)
        if self.engine.max_model_len > self.config.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({self.engine.max_model_len}) exceeds the model's "
                f"max_position_embeddings ({self.config.max_position_embeddings})"
            )
        self.weight_store = WeightStore(self.model, owned=weights is None)  # engine/weight_store.py
        num_blocks = self.engine.resolved_num_blocks()
        self.runner = ModelRunner(
            self.family,
            num_blocks,
            self.engine.block_size,
            self.engine.device,
            self.engine.torch_dtype,
            graph_sizes=self.engine.graph_sizes(),
            max_model_len=self.engine.max_model_len,
            profile=PROFILES[self.engine.numerics],
        )
        self.block_manager = BlockManager(num_blocks, self.engine.block_size, self.engine.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.engine.max_num_seqs,
            self.engine.resolved_batched_tokens(),
            self.block_manager,
            eos_token_ids=self.config.eos_token_id,
        )
        self._ids = itertools.count()
        self._rng = random.Random()
        self._tokenizer = None
        self.asleep = False
        self.core = EngineCore(self)  # requests in flight; its lock serializes this LLM's calls

    # -- requests ---------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int] | str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in prompt order.

        Every request is validated before anything runs; a bad one raises
        ValueError naming its index and field, and the engine stays usable.
        Calls from several threads run one after another (the engine lock).
        """
        self.core.refuse_if_serving("generate")
        with self.core.lock:
            if self.asleep:
                raise RuntimeError("generate: the engine is asleep (KV cache released); call wake_up() first")
            self.weight_store.require_loaded("generate")
            self.core.check_idle("generate")
            per_request = self._per_request_params(prompts, params)
            token_lists = [
                self._validate(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, per_request, strict=True))
            ]
            for i, sp in enumerate(per_request):
                self.core.check_text(i, sp)
            states = self._prepare_states(prompts, token_lists)
            rows = zip(token_lists, per_request, states, strict=True)
            try:
                ids = [self.core.add_validated(None, i, t, sp, st) for i, (t, sp, st) in enumerate(rows)]
                self._run_until_done(sum(sp.n for sp in per_request), progress)
            except BaseException:
                self.core.abort_all()
                raise
            return [self.core.pop(r) for r in ids]

    def _per_request_params(self, prompts, params) -> list[SamplingParams]:
        if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence):
            raise TypeError("prompts must be a list of prompts (token-id lists or strings)")
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            return [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        for i, sp in enumerate(params):
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"request {i}: params must be a SamplingParams, got {type(sp).__name__}")
        return params

    def _validate(self, i: int, prompt, sp: SamplingParams) -> list[int]:
        return check_request(i, prompt, sp, self.engine.max_model_len, self.config.vocab_size, self._tokenize)

    def _tokenize(self, i: int, text: str) -> list[int]:
        if self._tokenizer is None:
            has_files = any((self.path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
            try:
                if not has_files:
                    raise FileNotFoundError("no tokenizer.json or tokenizer_config.json")
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.path)
            except Exception as e:  # noqa: BLE001 - any failure means: no usable tokenizer
                raise no_tokenizer(i, self.path) from e
        return self._tokenizer(text)["input_ids"]

    def _prepare_states(self, prompts, token_lists) -> list:
        """Each request's state from the model family, checked before anything runs."""
        return [
            self.family.prepare(i, p, ids) for i, (p, ids) in enumerate(zip(prompts, token_lists, strict=True))
        ]

    def _new_seq(self, i: int, ids: list[int], sp: SamplingParams) -> Seq:
        if sp.logprob_formula is None and self.engine.logprob_formula != logprob_formulas.DEFAULT:
            sp = dataclasses.replace(sp, logprob_formula=self.engine.logprob_formula)
        if sp.logprobs_mode is None and self.engine.logprobs_mode != "raw_logprobs":
            sp = dataclasses.replace(sp, logprobs_mode=self.engine.logprobs_mode)
        problem = sp.logprobs_mode and logprobs_mode_problem(sp.logprobs_mode, sp.logprob_formula)
        if problem:
            raise ValueError(f"request {i}: {problem}")
        self._check_line(sp.logprob_formula)
        seq = Seq(seq_id=next(self._ids), index=i, prompt_token_ids=ids, params=sp)
        seq.seed = sp.seed if sp.seed is not None else self._rng.getrandbits(63)
        return seq

    def _check_line(self, formula) -> None:
        """Refuse a user's row function or fused line that is not row-invariant (checked once
        per function; a fused line with the engine's own LM head)."""
        if formula in self._row_invariant:
            return
        if isinstance(formula, FusedLine):
            logprob_formulas.check_fused_row_invariant(formula, self.model.lm_head.weight)
            self._row_invariant.add(formula)
        elif callable(formula):
            logprob_formulas.check_row_invariant(formula, self.config.vocab_size, self.engine.torch_dtype)
            self._row_invariant.add(formula)

    def _run_until_done(self, total: int, progress: bool | None) -> None:
        show = sys.stderr.isatty() and total > 1 if progress is None else progress
        bar = GenerateProgress(total) if show else None
        try:
            with self.runner.profile.context():  # installed once per call, not once per step
                self._steps(bar)
        finally:
            if bar:
                bar.close()

    def _steps(self, bar) -> None:
        """Engine-core steps until every request is done."""
        while self.core.has_unfinished():
            done = self.core.step()
            if bar:
                bar.advance(done.num_finished, self.core.stats.last_step_tokens)

    def _sample_requests(self, seqs: list[Seq], ahead: int = 0) -> list[SampleRequest]:
        """The sampling row of each sequence's next token (one loop for the batch: this runs
        for every row of every step); `ahead`: tokens sampled but not yet in token_ids."""
        never_sample, rows = self.family.never_sample, []
        row = tuple.__new__  # SampleRequest(...) without its Python-level __new__: 0.1 us less a row
        for seq in seqs:
            sp, k = seq.params, len(seq.token_ids) - seq.num_prompt_tokens + ahead  # its output index
            if k >= sp.min_tokens:  # (almost every row: nothing banned but the family's own)
                rows.append(row(SampleRequest, (sp, seq.seed, k, never_sample)))
            else:  # before min_tokens: no stop tokens, no eos
                stops = tuple(sp.stop_token_ids or ())
                banned = stops + (() if sp.ignore_eos else tuple(self.config.eos_token_id))
                rows.append(SampleRequest(sp, seq.seed, k, banned + never_sample))
        return rows

    # -- colocation -----------------------------------------------------------------------

    @exclusive
    def sleep(self) -> None:
        """Release the KV cache memory so a trainer on the same device can use it. Weights stay
        (update_weights and weight_digests still work); generate refuses until wake_up()."""
        if self.core.has_unfinished():
            raise RuntimeError("sleep: requests are still running")
        self.block_manager.reset_prefix_cache()  # wake_up brings a zeroed cache
        self.runner.release_kv_cache()
        self.asleep = True

    @exclusive
    def wake_up(self) -> None:
        """Allocate the KV cache again (zeroed); a no-op when awake."""
        self.runner.allocate_kv_cache()
        self.asleep = False

    def set_numerics(self, numerics: str) -> None:
        """Switch the numerics profile ("exact" or "fast") of this engine, weights kept.

        Takes effect from the next step; captured CUDA graphs are dropped (they hold the old
        profile's kernels) and captured again on use.
        """
        if numerics not in PROFILES:
            raise ValueError(f"numerics must be one of {tuple(PROFILES)}, got {numerics!r}")
        self.engine = dataclasses.replace(self.engine, numerics=numerics)
        self.runner.profile = PROFILES[numerics]
        self.block_manager.reset_prefix_cache()  # cached K/V are the old profile's bits
        if self.runner.graphs is not None:
            self.runner.graphs.reset()

    # -- prefix cache ---------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget every cached KV block, so no later request reuses K/V computed before.
        Call it after changing the weights by any path but `update_weights` (which calls it),
        e.g. after an optimizer step on tensors shared through `LLM(weights=...)` without
        `sleep()`. -> False, and nothing done, while requests are in flight."""
        with self.core.lock:
            if self.core.has_unfinished():
                return False
            self.block_manager.reset_prefix_cache()
            return True

    # -- weights (engine/weight_store.py) --------------------------------------------------

    @property
    def _params(self) -> dict[str, torch.nn.Parameter]:
        """{HF name: parameter}, tied aliases included."""
        return self.weight_store.params

    @exclusive
    def update_weights(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    ) -> None:
        """Copy new values into parameters by name: a {name: tensor} mapping or (name, tensor)
        pairs, named as transformers 5 names the parameters or with the hub's per-expert names
        (`...mlp.experts.{e}.{gate,up,down}_proj.weight`, each writing its expert's slice of
        the fused tensor). All-or-nothing: every name, shape, dtype, slice given twice and
        value (NaN or inf is refused, checked on the tensor's own device) is checked before any
        copy; on error the old weights stay, bitwise."""
        self.weight_store.update(named_tensors, "update_weights")
        self._after_weights_changed()

    @exclusive
    def update_weights_from_disk(self, model_path: str | Path) -> None:
        """Load the weights of another checkpoint of this model (same family and config.json
        shape; fused or per-expert experts, one file or shards; a hub id in the local cache),
        all or nothing: headers are checked before any data is read, then every tensor is read
        and checked finite, then read again and copied. On error the old weights stay, bitwise.
        `LLM.path` stays the original directory (config, tokenizer and generation_config come
        from there); only the weights change."""
        load_from_disk(self.weight_store, self.family, resolve_model_path(model_path))
        self._after_weights_changed()

    def _after_weights_changed(self) -> None:
        """Called after every change of the weights (update_weights, update_weights_from_disk,
        resume_memory_occupation). Cached K/V computed under the old weights are stale: the
        prefix cache is reset (safe with requests in flight: `BlockManager.reset_prefix_cache`)."""
        self.block_manager.reset_prefix_cache()

    def weight_digests(self, names: Iterable[str] | str | None = None, kind: str = "sha256") -> dict[str, str]:
        """Hex digest of each named parameter (all parameters when names is None; a single str
        is one name). kind: "sha256" (the raw bytes, on the host) or "fast" (a non-cryptographic
        checksum computed on the parameter's device, no host copy: `samebits.engine.digest`).
        RuntimeError for a tensor not loaded since resume_memory_occupation()."""
        return self.weight_store.digests(names, kind)

    # -- memory occupation (SGLang's tags) ----------------------------------------------------

    @exclusive
    def release_memory_occupation(self, tags: Iterable[str] | None = None) -> None:
        """Free device memory, as SGLang's engine: tag "kv_cache" is `sleep()`, tag "weights"
        frees every parameter's storage (refused for shared weights, `LLM(weights=...)`).
        tags=None: both. Requests are refused until `resume_memory_occupation` (and, for
        weights, until new weights are pushed)."""
        tags = _memory_tags(tags)
        if "weights" in tags:
            self.weight_store.release()  # refuses first when the engine does not own them
            self._reset_graphs()
        if "kv_cache" in tags:
            self.runner.release_kv_cache()
            self.asleep = True
        if "weights" in tags and self.runner.device.type == "cuda":
            torch.cuda.empty_cache()

    @exclusive
    def resume_memory_occupation(self, tags: Iterable[str] | None = None) -> None:
        """Allocate again what `release_memory_occupation` freed (tags=None: both). Weights come
        back zeroed and marked not loaded: push them with update_weights(...) or
        update_weights_from_disk(path) before generating (a no-op for weights not released)."""
        tags = _memory_tags(tags)
        if "kv_cache" in tags:
            self.runner.allocate_kv_cache()
            self.asleep = False
        if "weights" in tags and self.weight_store.released:
            self.weight_store.resume()
            self._reset_graphs()
            self._after_weights_changed()

    def _reset_graphs(self) -> None:
        """Captured CUDA graphs hold the parameters' addresses: drop them (captured on use)."""
        if self.runner.graphs is not None:
            self.runner.graphs.reset()


MEMORY_TAGS = ("kv_cache", "weights")


def _memory_tags(tags) -> frozenset[str]:
    if tags is None:
        return frozenset(MEMORY_TAGS)
    if isinstance(tags, str) or not isinstance(tags, Iterable):
        raise ValueError(f"tags must be a list of {list(MEMORY_TAGS)} or None, got {tags!r}")
    tags = list(tags)
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"unknown memory tag(s) {unknown}; valid tags are {list(MEMORY_TAGS)} (None: both)")
    return frozenset(tags)
