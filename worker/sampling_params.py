"""Per-request generation options, with the bounds every caller is held to."""

import math
from dataclasses import dataclass

from meridian.errors import UserError

MAX_LOGPROBS = 20
MAX_TEMPERATURE = 2.0  # OpenAI's bound; hotter than this is noise
# Below this a temperature is greedy (as vLLM does): logits / temperature would otherwise overflow.
GREEDY_TEMPERATURE = 1e-5
MAX_STOP = 16
# The detokenizer holds back as much text as the longest stop string, so this bounds that delay.
MAX_STOP_CHARS = 256


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy (exact argmax)
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    seed: int | None = None  # same seed, same prompt -> same output, whatever else is batched
    stop: tuple[str, ...] = ()  # generation ends before the first occurrence of any of these
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; N: the sampled token's logprob and the top N

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (
                math.isfinite(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE,
                f"temperature must be from 0 (greedy) to {MAX_TEMPERATURE:g}, got {self.temperature}",
            ),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}"),
            (
                self.seed is None or -(2**63) <= self.seed < 2**64,
                f"seed must be a 64-bit integer, got {self.seed}",
            ),
            (
                len(self.stop) <= MAX_STOP,
                f"at most {MAX_STOP} stop strings are allowed, got {len(self.stop)}",
            ),
            (
                all(0 < len(s) <= MAX_STOP_CHARS for s in self.stop),
                f"each stop string must have 1 to {MAX_STOP_CHARS} characters",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise UserError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE
