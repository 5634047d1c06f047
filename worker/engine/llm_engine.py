"""The engine: requests in, token and text deltas out, one batched model step at a time.

Before each step, requests past their deadline are aborted. A request that fails in a step (in the
model, the sampler or the detokenizer) ends with finish_reason "error" and the others go on; only
an engine whose steps fail whatever runs in them raises.
"""

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from meridian.errors import UserError
from meridian.worker.detokenizer import IncrementalDetokenizer
from meridian.worker.engine.block_manager import BlockManager
from meridian.worker.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from meridian.worker.engine.sequence import Sequence
from meridian.worker.loaders import DEFAULT_MODEL, Checkpoint, load_checkpoint
from meridian.worker.model_runner import ModelRunner
from meridian.worker.sampling_params import SamplingParams

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Steps in a row in which some sequence failed even alone: past this the engine, not a request, is
# at fault (a request that breaks its step fails alone and leaves).
MAX_FAILING_STEPS = 3


class EngineBrokenError(RuntimeError):
    """Steps fail whatever runs in them; no request can be served."""


@dataclass(frozen=True)
class EngineSettings:
    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_waiting: int = 256  # requests queued beyond what the running batch has room for
    max_model_len: int | None = None  # None: the model's own context length
    kv_cache_memory: float | None = None  # bytes if > 1, else fraction of free memory
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise UserError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise UserError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_waiting < 0:
            raise UserError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise UserError("kv_cache_memory must be positive (bytes, or a fraction <= 1)")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise UserError(f"device {self.device!r} requested but no CUDA device is available")


@dataclass
class RequestOutput:
    """What one request produced in one step (deltas), plus its running totals."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # what failed, when finish_reason is "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # per new token: (token id, logprob, [(token id, logprob)] top-N); None if not requested
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    # seconds from arrival to the first step that ran it; None while it has only waited
    queue_time: float | None = None


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    preemptions: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0  # tokens
    prompt_tokens_computed: int = 0  # prefill work actually done (cache hits excluded)
    generation_tokens: int = 0
    steps: int = 0
    last_batch_tokens: int = 0
    last_batch_seqs: int = 0
    batch_seqs_total: int = 0  # sum over steps: mean batch size = this / steps


# A sequence that sampled in a step: its token, and (logprob, top-N) when it asked for them.
_Sample = tuple[Sequence, int, tuple[float, list[tuple[int, float]]] | None]


@dataclass
class _Request:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    eos: set[int] = field(default_factory=set)


class LLMEngine:
    def __init__(self, settings: EngineSettings, checkpoint: Checkpoint | None = None):
        self.settings = settings
        checkpoint = checkpoint or load_checkpoint(settings.model)
        self.model_name = checkpoint.name
        self.tokenizer = checkpoint.tokenizer
        self.runner = ModelRunner(
            checkpoint,
            DTYPES[settings.dtype],
            torch.device(settings.device),
            settings.block_size,
            settings.kv_cache_memory,
        )
        max_len = min(
            settings.max_model_len or checkpoint.config.max_model_len,
            checkpoint.config.max_model_len,
        )
        self.max_model_len = max_len
        self.block_manager = BlockManager(
            self.runner.num_blocks, settings.block_size, settings.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                settings.max_num_seqs,
                settings.max_num_batched_tokens,
                max_len,
                settings.enable_chunked_prefill,
            ),
            self.block_manager,
        )
        self._requests: dict[str, _Request] = {}
        self._arrivals = itertools.count()
        self._stats = EngineStats(kv_blocks_total=self.runner.num_blocks)
        self._failing_steps = 0

    # ---- requests ------------------------------------------------------------------------------

    def make_sequence(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        deadline: float | None = None,
    ) -> Sequence:
        """Tokenize and check a request without queueing it (safe from any thread). Past its
        `deadline` (a time.monotonic() value) the request is aborted."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        vocab = self.runner.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise UserError(f"prompt token ids must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise UserError(f"stop_token_ids must be in [0, {vocab})")
        seq = Sequence(request_id, ids, params, next(self._arrivals), priority, deadline)
        self.scheduler.check_admissible(seq)
        return seq

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | Sequence,
        params: SamplingParams | None = None,
        priority: int = 0,
        deadline: float | None = None,
    ) -> Sequence:
        if request_id in self._requests:
            raise UserError(f"request id {request_id!r} is already in use")
        seq = (
            prompt
            if isinstance(prompt, Sequence)
            else self.make_sequence(
                request_id, prompt, params or SamplingParams(), priority, deadline
            )
        )
        eos = set() if seq.params.ignore_eos else set(self.tokenizer.eos_token_ids)
        self._requests[request_id] = _Request(
            seq, IncrementalDetokenizer(self.tokenizer, seq.params.stop), eos
        )
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV blocks. Returns its last output (finish_reason
        "abort", no new tokens), or None if it is not known (already finished)."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.finish(req.seq, "abort")
        return self._output(req, [], "abort", None)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # ---- stepping ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batched step. A request that fails in it (in the model, the sampler or the
        detokenizer) ends with finish_reason "error"; the others go on. Raises only when the
        engine itself is broken (EngineBrokenError, MemoryError)."""
        now = time.monotonic()
        outputs = self._abort_expired(now)
        batch = self.scheduler.schedule()
        if not batch:
            return outputs
        for seq, _ in batch.prefills:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        samples, failures = self._execute(batch)
        outputs += [self._fail(seq, error) for seq, error in failures]
        done = batch.without({seq for seq, _ in failures})
        self.scheduler.on_step_done(done)
        self._count(done)
        for seq, token, logprob in samples:
            try:
                outputs.append(self._advance(seq, token, logprob))
            except MemoryError:
                raise
            except Exception as e:
                log.exception("request %s failed after its step", seq.request_id)
                outputs.append(self._fail(seq, e))
        return outputs

    def _abort_expired(self, now: float) -> list[RequestOutput]:
        expired = [
            request_id
            for request_id, req in self._requests.items()
            if req.seq.deadline is not None and req.seq.deadline <= now
        ]
        return [self.abort(request_id) for request_id in expired]

    def _execute(
        self, batch: ScheduledBatch
    ) -> tuple[list[_Sample], list[tuple[Sequence, Exception]]]:
        """Run the batch; if it fails, run each of its sequences alone: those that fail again are
        the culprits, and the others' samples stand. Retrying is safe: nothing has advanced yet,
        and a re-run writes the same KV slots (and draws the same sampling noise)."""
        try:
            samples = self._run(batch)
            self._failing_steps = 0
            return samples, []
        except MemoryError:
            raise
        except Exception:
            log.exception("a step failed; running its sequences one at a time")
        singles = batch.singles()
        samples, failures = [], []
        for seq, single in singles:
            try:
                samples += self._run(single)
            except MemoryError:
                raise
            except Exception as e:
                log.exception("request %s fails its step alone", seq.request_id)
                failures.append((seq, e))
        self._failing_steps = self._failing_steps + 1 if failures else 0
        if len(failures) == len(singles) > 1 or self._failing_steps >= MAX_FAILING_STEPS:
            raise EngineBrokenError(
                f"steps keep failing whatever runs in them: {failures[0][1]}"
            ) from failures[0][1]
        return samples, failures

    def _run(self, batch: ScheduledBatch) -> list[_Sample]:
        sampled, result = self.runner.execute(batch)
        return list(zip(sampled, result.token_ids, result.logprobs, strict=True))

    def _advance(self, seq: Sequence, token: int, logprob) -> RequestOutput:
        req = self._requests[seq.request_id]
        seq.token_ids.append(token)
        req.detokenizer.push(token)
        reason = self._finish_reason(req, token)
        if reason:
            self.scheduler.finish(seq, reason)
            del self._requests[seq.request_id]
        lp = None if logprob is None else [(token, logprob[0], logprob[1])]
        return self._output(req, [token], reason, lp)

    def _fail(self, seq: Sequence, error: Exception) -> RequestOutput:
        """End a request that failed on its own and free its blocks."""
        self._requests.pop(seq.request_id, None)
        self.scheduler.finish(seq, "error")
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=[],
            text="",
            finished=True,
            finish_reason="error",
            error=f"{type(error).__name__}: {error}",
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
            cached_tokens=seq.num_cached_tokens,
        )

    def _finish_reason(self, req: _Request, token: int) -> str | None:
        seq, p = req.seq, req.seq.params
        if req.detokenizer.stopped or token in req.eos or token in p.stop_token_ids:
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(
        self, req: _Request, tokens: list[int], reason: str | None, logprobs
    ) -> RequestOutput:
        seq = req.seq
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=tokens,
            text=req.detokenizer.take(final=reason is not None),
            finished=reason is not None,
            finish_reason=reason,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
            cached_tokens=seq.num_cached_tokens,
            logprobs=logprobs,
            queue_time=None
            if seq.first_scheduled_time is None
            else seq.first_scheduled_time - seq.arrival_time,
        )

    def _count(self, batch) -> None:
        s = self._stats
        s.steps += 1
        s.generation_tokens += len(batch.decodes) + sum(
            1 for seq, n in batch.prefills if seq.num_computed_tokens == seq.num_tokens
        )
        s.prompt_tokens_computed += sum(n for _, n in batch.prefills)
        s.last_batch_tokens = batch.num_tokens
        s.last_batch_seqs = len(batch.decodes) + len(batch.prefills)
        s.batch_seqs_total += s.last_batch_seqs

    def stats(self) -> EngineStats:
        s = self._stats
        s.running = len(self.scheduler.running)
        s.waiting = len(self.scheduler.waiting)
        s.preemptions = self.scheduler.num_preemptions
        s.kv_blocks_used = self.block_manager.num_blocks - self.block_manager.num_free_blocks
        s.prefix_cache_queries = self.block_manager.prefix_queries
        s.prefix_cache_hits = self.block_manager.prefix_hits
        return EngineStats(**vars(s))

    # ---- offline -------------------------------------------------------------------------------

    def generate(
        self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[RequestOutput]:
        """Run every prompt to completion together; one final output per prompt, in order.
        Each output carries the whole generation (all token ids, all text)."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"offline-{next(self._arrivals)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, params, strict=True):
            self.add_request(rid, prompt, p)
        done: dict[str, RequestOutput] = {rid: RequestOutput(rid, [], "") for rid in ids}
        while self.has_unfinished():
            for out in self.step():
                acc = done[out.request_id]
                acc.token_ids += out.token_ids
                acc.text += out.text
                if out.logprobs is not None:
                    acc.logprobs = (acc.logprobs or []) + out.logprobs
                acc.finished, acc.finish_reason = out.finished, out.finish_reason
                acc.error = out.error
                acc.prompt_tokens, acc.completion_tokens = out.prompt_tokens, out.completion_tokens
                acc.cached_tokens = out.cached_tokens
        return [done[rid] for rid in ids]
