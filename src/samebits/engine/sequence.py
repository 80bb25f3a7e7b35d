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
    """

    def __init__(self, seq_id: int, index: int, prompt_token_ids: list[int], params: SamplingParams):
        self.seq_id = seq_id
        self.index = index  # position in the caller's prompt list
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + generated
        self.logprobs: list[float] = []
        self.params = params
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

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

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
