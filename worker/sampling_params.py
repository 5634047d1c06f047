"""Per-request generation options."""

from dataclasses import dataclass

from meridian.errors import UserError

MAX_LOGPROBS = 20


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
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}"),
            (all(self.stop), "stop strings must not be empty"),
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
        return self.temperature == 0
