"""The engine core: requests in flight, one step at a time.

`EngineCore` owns the schedule -> run -> postprocess loop that `LLM.generate` and the
`AsyncEngine` both drive. Requests come and go between steps (`add_request`, `abort`);
`step()` runs one batch and reports what each sample gained. A request is n sequences
(its samples); every sequence is sampled from its own seed and output index only, and
every kernel is batch invariant, so what a request gets never depends on what else ran.

Not thread safe by itself: callers hold `lock` (the LLM's methods do, through
`exclusive`; the AsyncEngine's thread does, per step).
"""

from __future__ import annotations

import functools
import itertools
import threading
import time

import torch

from samebits.engine.detokenizer import IncrementalDetokenizer, load_tokenizer
from samebits.engine.outputs import CompletionOutput, EngineStats, RequestOutput, StepOutput
from samebits.engine.prompt_logprobs import as_logprobs
from samebits.engine.sequence import Sequence as Seq
from samebits.engine.validation import check_text
from samebits.requests.sampling_params import SamplingParams, sample_seed


class _Request:
    def __init__(self, request_id: str, index: int, prompt_ids: list[int], params: SamplingParams):
        self.request_id = request_id
        self.index = index
        self.prompt_ids = prompt_ids
        self.params = params
        self.seqs: list[Seq] = []
        self.detoks: list[IncrementalDetokenizer | None] = []
        self.tops: list[list] = []
        self.kept: list[list[int]] = []
        self.prompt_sent = 0  # prompt positions `progress` has handed on (`prompt_logprobs`)
        self.prompt_logprobs = None  # RequestOutput.prompt_logprobs, built once the prompt is scored


def _processed(params: SamplingParams) -> bool:
    return (params.logprobs_mode or "").startswith("processed")


def exclusive(method):
    """Run an LLM method holding its engine lock, so a call from another thread waits its
    turn; refused while requests are in flight (an AsyncEngine's), which it would corrupt."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        self.core.refuse_if_serving(method.__name__)
        with self.core.lock:
            self.core.check_idle(method.__name__)
            return method(self, *args, **kwargs)

    return locked


class EngineCore:
    """Requests in flight over one LLM's scheduler and runner."""

    def __init__(self, llm):
        self.llm = llm
        self.lock = threading.RLock()
        self.stats = EngineStats()
        self._requests: dict[str, _Request] = {}
        self._by_seq: dict[int, tuple[_Request, int]] = {}  # seq_id -> (request, sample index)
        # seq_id -> (request, sample index), only for samples whose tokens need more than the
        # scheduler's bookkeeping each step (a detokenizer or top log-probs): `_advance`
        self._watched: dict[int, tuple[_Request, int]] = {}
        self._auto_ids = itertools.count()
        self._tokenizer = None
        self._tokenizer_loaded = False
        self.serving = False  # an AsyncEngine's thread steps this core (set by AsyncEngine)
        self.async_scheduling = llm.engine.resolved_async_scheduling()
        self._inflight = None  # (batch, sampled seqs, Pending) of a step launched ahead

    @property
    def tokenizer(self):
        """The checkpoint's tokenizer, loaded on first use; None when it has none."""
        if not self._tokenizer_loaded:
            self._tokenizer = load_tokenizer(self.llm.path)
            self._tokenizer_loaded = True
        return self._tokenizer

    # -- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str | None, prompt, params: SamplingParams, index: int = 0) -> str:
        """Validate (ValueError naming the field) and queue one request's n samples; -> its id.
        RuntimeError while the weights are released or not all pushed since a resume."""
        self.check_runnable("add_request")
        ids = self.llm._validate(index, prompt, params)
        self.check_text(index, params)
        state = self.llm._prepare_states([prompt], [ids])[0]
        return self.add_validated(request_id, index, ids, params, state)

    def check_text(self, i: int, params: SamplingParams) -> None:
        """ValueError when a request asks for text features the checkpoint cannot give."""
        check_text(i, params, self.tokenizer, self.llm.path)

    def refuse_if_serving(self, what: str) -> None:
        """Refuse at once, before waiting on the lock, while an AsyncEngine has requests in
        flight: its thread takes the lock step after step and would keep the caller waiting
        for the whole batch. Plain `generate` calls from several threads still wait their turn."""
        if self.serving:
            self.check_idle(what)

    def check_idle(self, what: str) -> None:
        if self.has_unfinished():
            n = len(self._requests)
            raise RuntimeError(
                f"{what}: {n} requests are in flight on this engine (an AsyncEngine's; or a step "
                "launched ahead is still draining); wait for them to finish or abort them first"
            )

    def check_runnable(self, where: str) -> None:
        """RuntimeError while a request could not run: KV cache or weights released, or weights
        not all pushed since a resume (`release_memory_occupation` / `sleep`)."""
        if self.llm.asleep:
            raise RuntimeError(
                f"{where}: the KV cache is released; resume_memory_occupation(['kv_cache']) "
                "(or wake_up()) first"
            )
        self.llm.weight_store.require_loaded(where)

    def add_validated(self, request_id, index: int, ids: list[int], params: SamplingParams, state=None) -> str:
        """Queue an already validated request's n samples; sample j gets `sample_seed(seed, j)`.
        RuntimeError (nothing queued) while `check_runnable` refuses."""
        self.check_runnable("add_request")
        request_id = f"req-{next(self._auto_ids)}" if request_id is None else str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        req = _Request(request_id, index, ids, params)
        for j in range(params.n):
            seq = self.llm._new_seq(index, ids, params)
            if j:
                seq.seed = sample_seed(req.seqs[0].seed, j)
            seq.family_state = state
            seq.request_id = request_id
            if j == 0 and params.prompt_logprobs is not None:
                seq.prompt_scores = []  # the first sample scores the prompt (engine/prompt_logprobs.py)
                self.llm.runner.scoring += len(ids) > 1  # (a 1-token prompt has nothing to score)
            req.seqs.append(seq)
            req.detoks.append(self._detokenizer(ids, params))
            req.tops.append([])
            req.kept.append([])
        for seq in req.seqs:  # may raise (a sequence larger than the cache): nothing queued
            self.llm.scheduler.check_fits(seq)
        self._requests[request_id] = req
        for j, seq in enumerate(req.seqs):
            self._by_seq[seq.seq_id] = (req, j)
            if params.logprobs or req.detoks[j] is not None or _processed(seq.params):
                self._watched[seq.seq_id] = (req, j)
            self.llm.scheduler.add(seq)
        return request_id

    def _detokenizer(self, ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if not params.detokenize or self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, ids, params.stop)

    def abort(self, request_id: str) -> bool:
        """Finish every unfinished sample of the request with "abort", freeing its KV blocks
        at once. -> False when no such request is known."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        if not all(s.is_finished for s in req.seqs):
            self.stats.aborted_requests += 1
        first = req.seqs[0]  # it will not score the rest (once: a second abort finds it finished)
        if not first.is_finished and first.prompt_scores is not None:
            self.llm.runner.scoring -= first.num_prompt_scored < first.num_prompt_tokens - 1
        for seq, detok in zip(req.seqs, req.detoks, strict=True):
            if not seq.is_finished:
                self.llm.scheduler.finish(seq, "abort")
                if detok:
                    detok.finish()
        return True

    def abort_all(self) -> None:
        """Abort and forget every request (after an error inside a step)."""
        self.llm.scheduler.abort_all()
        if self._inflight is not None:  # wait for it: it may still read weights and write K/V
            try:
                self._inflight[2].result()
            except Exception:  # noqa: BLE001 - the step's own failure: nothing to wait for
                pass
            self._inflight = None
        self._requests.clear()
        self._by_seq.clear()
        self._watched.clear()
        self.llm.runner.scoring = 0

    def has_unfinished(self) -> bool:
        """Requests still running, or a step launched ahead whose samples are not read yet."""
        return self._inflight is not None or self.llm.scheduler.has_unfinished()

    def request_ids(self) -> list[str]:
        return list(self._requests)

    # -- one step -------------------------------------------------------------------------

    def step(self) -> StepOutput:
        """Schedule -> run -> postprocess one batch; -> the requests that gained tokens.

        Async scheduling (`EngineConfig.async_scheduling`): before this step's samples are
        read, the next step is scheduled and launched with this step's samples as its decode
        rows' input ids on the device (`_launch_ahead`; it may admit and prefill waiting
        sequences too), so the host's bookkeeping overlaps the device's work; the next call
        reads that step's samples. A row whose sequence ended
        meanwhile (a stop token or string, an abort) is dropped; the others get the bits they
        get without it, since every kernel is batch invariant and a row's randomness is its
        seed and output index only."""
        sched = self.llm.scheduler
        if self._inflight is None and not sched.has_unfinished():
            return StepOutput([], 0)
        t0 = time.perf_counter()
        if self._inflight is None:
            batch = sched.schedule()
            seqs = [c.seq for c in batch.chunks if c.samples]  # the rows sampled, in batch order
            pending = self.llm.runner.launch(batch, self.llm._sample_requests(seqs))
        else:
            (batch, seqs, pending), self._inflight = self._inflight, None
        if self.async_scheduling:
            self._inflight = self._launch_ahead(batch, seqs, pending)
        sampled = pending.result()
        live = [s for s in seqs if not s.is_finished]  # (all of them, but after an async stop)
        by_id = dict(zip([s.seq_id for s in seqs], sampled, strict=True))
        num_finished = len(sched.postprocess(batch, by_id)) + self._advance_watched(live, by_id)
        touched = dict.fromkeys([s.request_id for s in live])  # each request once, in batch order
        out = StepOutput(list(touched), num_finished)
        self.stats.steps += 1
        self.stats.generated_tokens += len(live)
        self.stats.last_step_tokens = batch.num_tokens
        self.stats.prefix_cache_queries += batch.prefix_cache_queries
        self.stats.prefix_cache_hits += batch.prefix_cache_hits
        self.stats.last_step_seconds = time.perf_counter() - t0
        self.stats.step_seconds += self.stats.last_step_seconds
        return out

    def _launch_ahead(self, batch, seqs: list[Seq], pending):
        """Schedule and launch the step after `batch` (whose samples `pending` holds, maybe
        not yet computed) -> (its batch, its sampled seqs, its Pending), or None where only the
        synchronous scheduler can decide the next step (`Scheduler.plan_ahead`) or the cache
        lacks a block. The step may admit waiting sequences and go on with chunked prefills
        (their ids are known here) beside the decode rows fed by `batch`'s samples on the
        device; every row's sample is left on the device (`sampler.sample_pending`)."""
        llm, sched = self.llm, self.llm.scheduler
        plan = sched.plan_ahead(batch)
        ahead = sched.commit_ahead(plan) if plan is not None else None
        if ahead is None:
            return None
        nxt = [c.seq for c in ahead.chunks if c.samples]
        if len(nxt) == plan.fed:  # (every decode step: all its rows one token ahead)
            reqs = llm._sample_requests(nxt, ahead=1)
        else:  # (fed rows one token ahead; prefills and admissions have every token)
            reqs = [llm._sample_requests([c.seq], ahead=int(c.ahead))[0] for c in ahead.chunks if c.samples]
        row = {s.seq_id: i for i, s in enumerate(seqs)}
        src = [row[c.seq.seq_id] if c.ahead else -1 for c in ahead.chunks]
        return ahead, nxt, llm.runner.launch(ahead, reqs, (src, pending.tokens))

    def _advance_watched(self, seqs: list[Seq], by_id: dict[int, tuple]) -> int:
        """`_advance` the watched samples among the sampled seqs, in batch order; -> how
        many a stop string finished. Most rows (no text, no top log-probs) cost nothing here."""
        if not self._watched:
            return 0
        watched = [seq for seq in seqs if seq.seq_id in self._watched]
        return sum(self._advance(seq, by_id[seq.seq_id]) for seq in watched)

    def _advance(self, seq: Seq, out: tuple) -> bool:
        """Keep a watched sample's top log-probs and text; -> whether a stop string in its
        text finished it now (a sample the scheduler finished was counted there)."""
        req, j = self._watched[seq.seq_id]
        if req.params.logprobs:
            req.tops[j].append(out[2])
        if len(out) > 3:  # a processed row's kept count (sampler.Kept)
            req.kept[j].append(out[3])
        detok, stopped_now = req.detoks[j], False
        if detok is not None:
            detok.add(out[0])
            if detok.stopped is not None:
                if seq.is_finished:
                    seq.finish_reason = "stop"
                else:
                    self.llm.scheduler.finish(seq, "stop")
                    stopped_now = True
            if seq.is_finished:
                detok.finish()
        return stopped_now

    # -- results --------------------------------------------------------------------------

    def is_finished(self, request_id: str) -> bool:
        return all(s.is_finished for s in self._requests[request_id].seqs)

    def progress(self, request_id: str, sent: list[int]) -> tuple[list[tuple], int, list]:
        """What each sample gained since its first `sent[j]` tokens, as plain Python values
        (for another process): -> ([(new ids, new log-probs, new top-k lists or None, text,
        finish reason, new num_kept or None)], sample 0's preemptions, the prompt positions
        scored since the last call (`PromptScore`s; [] when not asked)). Advances `sent` to the
        current counts."""
        req = self._requests[request_id]
        scores = req.seqs[0].prompt_scores or []
        new_scores, req.prompt_sent = scores[req.prompt_sent :], len(scores)
        parts = []
        for j, seq in enumerate(req.seqs):
            k, out = sent[j], seq.output_token_ids
            tops = req.tops[j][k:] if req.params.logprobs else None
            kept = list(req.kept[j][k:]) if _processed(seq.params) else None
            text = req.detoks[j].text if req.detoks[j] is not None else ""
            parts.append((list(out[k:]), list(seq.logprobs[k:]), tops, text, seq.finish_reason, kept))
            sent[j] = len(out)
        return parts, req.seqs[0].num_preemptions, new_scores

    def output(self, request_id: str) -> RequestOutput:
        """A snapshot of the request so far (cumulative tokens, log-probs and text)."""
        req = self._requests[request_id]
        outs = [
            CompletionOutput(
                index=j,
                token_ids=list(seq.output_token_ids),
                logprobs=torch.tensor(seq.logprobs, dtype=torch.float32),
                text=req.detoks[j].text if req.detoks[j] is not None else "",
                finish_reason=seq.finish_reason,
                top_logprobs=list(req.tops[j]) if req.params.logprobs else None,
                num_kept=list(req.kept[j]) if _processed(seq.params) else None,
            )
            for j, seq in enumerate(req.seqs)
        ]
        first = outs[0]
        return RequestOutput(
            index=req.index,
            prompt_token_ids=list(req.prompt_ids),
            token_ids=first.token_ids,
            logprobs=first.logprobs,
            finish_reason=first.finish_reason,
            num_preemptions=req.seqs[0].num_preemptions,
            text=first.text,
            top_logprobs=first.top_logprobs,
            num_kept=first.num_kept,
            request_id=request_id,
            outputs=outs,
            prompt_logprobs=self._prompt_logprobs(req),
        )

    def _prompt_logprobs(self, req: _Request):
        """The request's `prompt_logprobs` once its prompt is scored, else None."""
        seq = req.seqs[0]
        if req.prompt_logprobs is None and seq.prompt_scores is not None:
            if len(seq.prompt_scores) >= seq.num_prompt_tokens - 1:  # built once, when complete
                req.prompt_logprobs = as_logprobs(seq.prompt_scores)
        return req.prompt_logprobs

    def pop(self, request_id: str) -> RequestOutput:
        """The request's final output; the core forgets it (its samples must be finished)."""
        if not self.is_finished(request_id):
            raise RuntimeError(f"request {request_id!r} is still running")
        out = self.output(request_id)
        req = self._requests.pop(request_id)
        for seq in req.seqs:
            self._by_seq.pop(seq.seq_id, None)
            self._watched.pop(seq.seq_id, None)
        return out
