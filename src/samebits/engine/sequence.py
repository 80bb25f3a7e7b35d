"""The object that travels from scheduler to runner: one request's state."""

from __future__ import annotations

import enum

from samebits.requests import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is: queued (or preempted), holding cache blocks, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request: prompt + generated tokens, their log-probs, its cache blocks.

    `token_ids` is the whole sequence; after a preemption its generated tokens are
    recomputed like prompt tokens, so chunks index `token_ids`, never the prompt alone.
    Slotted: the scheduler and core read a running sequence's fields a few times per step.
    """

    __slots__ = (
        "seq_id",
        "index",
        "prompt_token_ids",
        "num_prompt_tokens",
        "token_ids",
        "logprobs",
        "params",
        "max_num_tokens",
        "min_num_tokens",
        "stop_ids",
        "seed",
        "status",
        "block_table",
        "num_computed_tokens",
        "block_hashes",
        "num_hashed_blocks",
        "cache_epoch",
        "finish_reason",
        "num_preemptions",
        "family_state",
        "request_id",
        "prompt_scores",
        "num_prompt_scored",
        "__weakref__",  # the CUDA graphs' kept table rows drop a sequence's row when it dies
    )

    def __init__(self, seq_id: int, index: int, prompt_token_ids: list[int], params: SamplingParams):
        self.seq_id = seq_id
        self.index = index  # position in the caller's prompt list
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + generated
        self.logprobs: list[float] = []
        self.params = params  # frozen, so what follows from it is computed once here
        self.num_prompt_tokens = len(self.prompt_token_ids)
        # len(token_ids) at which it finishes by length / from which stop tokens count
        self.max_num_tokens = self.num_prompt_tokens + params.max_tokens
        self.min_num_tokens = self.num_prompt_tokens + params.min_tokens
        # the tokens that finish it past min_tokens: its stop_token_ids, and the model's eos
        # unless ignore_eos (the scheduler knows the eos ids and adds them in `Scheduler.add`)
        self.stop_ids = frozenset(params.stop_token_ids or ())
        self.seed = 0 if params.seed is None else params.seed  # LLM draws one when params.seed is None
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        # prefix sharing (block_manager.py): the chained hash of each full block of token_ids so
        # far (memoised: tokens only grow), how many leading blocks of block_table are published
        # or were taken from the cache, and the cache epoch the sequence started computing in
        self.block_hashes: list[bytes] = []
        self.num_hashed_blocks = 0
        self.cache_epoch = 0
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.family_state = None  # what the model family's `prepare` made of the prompt (None: text)
        self.request_id: str | None = None  # the engine core's request this is a sample of
        # `prompt_logprobs`: the scored prompt positions (engine/prompt_logprobs.py), on the
        # request's first sample only (None on the others and when not asked), and how many
        # positions the steps launched so far score
        self.prompt_scores: list | None = None
        self.num_prompt_scored = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprob: float) -> None:
        """Record one sampled token and its log-prob."""
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, status={self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
