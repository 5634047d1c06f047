"""One request's tokens and progress through the engine (plain Python: no torch)."""

import time
from enum import Enum, auto

from meridian.worker.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival: int,
        priority: int = 0,
        deadline: float | None = None,
    ):
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)  # prompt, then generated tokens
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.arrival = arrival  # admission order among all requests
        self.priority = priority  # lower runs first
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.block_hashes: list[int] = []  # prefix-cache hashes of the leading computed full blocks
        self.admitted_once = False
        self.finish_reason: str | None = None
        self.sampler_state = None  # the model runner's per-request RNG, kept across preemption
        self.arrival_time = time.monotonic()  # seconds; queue time = first_scheduled_time - this
        self.first_scheduled_time: float | None = None
        self.deadline = deadline  # time.monotonic() after which nobody waits for the answer

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def in_prefill(self) -> bool:
        """Still has more than the last token to compute (a prompt, or a recompute after preemption)."""
        return self.num_tokens - self.num_computed_tokens > 1

    def queue_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )
