"""`model: "auto"`: the gateway picks between a small and a large model for each request.

The small model answers when the prompt is short (at most `max_small_prompt_tokens`) and the request
caps its answer short (`max_tokens` set and at most `max_small_output_tokens`); anything else goes
to the large model. A short prompt asking for a short answer (a classification, a rewrite, a yes or
no) rarely needs the large model, and the small one answers it sooner and cheaper. Long inputs and
long outputs are where the large model's quality and context length matter. An unset `max_tokens`
lets the answer run to the end of the context window, so it counts as long.
"""

from dataclasses import dataclass

from meridian.errors import UserError

AUTO = "auto"


@dataclass(frozen=True)
class AutoModel:
    small: str
    large: str
    max_small_prompt_tokens: int = 512
    max_small_output_tokens: int = 256

    def __post_init__(self) -> None:
        if not self.small or not self.large:
            raise UserError("--auto-model needs two model names: SMALL,LARGE")
        if self.small == self.large:
            raise UserError(
                f"--auto-model names {self.small!r} twice; give a small and a large model"
            )
        if AUTO in (self.small, self.large):
            raise UserError(f"{AUTO!r} cannot be one of the --auto-model models; name real ones")
        if self.max_small_prompt_tokens < 1 or self.max_small_output_tokens < 1:
            raise UserError("the small model's prompt and output token limits must be positive")


def parse_auto_model(value: str) -> AutoModel:
    """`--auto-model SMALL,LARGE`, e.g. `--auto-model llama-1b,llama-70b`."""
    names = [name.strip() for name in value.split(",")]
    if len(names) != 2 or not all(names):
        raise UserError(
            f"--auto-model wants two model names, small first: SMALL,LARGE; got {value!r}"
        )
    return AutoModel(small=names[0], large=names[1])


def pick(policy: AutoModel, prompt_tokens: int, max_tokens: int | None) -> str:
    short_prompt = prompt_tokens <= policy.max_small_prompt_tokens
    short_answer = max_tokens is not None and max_tokens <= policy.max_small_output_tokens
    return policy.small if short_prompt and short_answer else policy.large
