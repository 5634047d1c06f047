"""What runs each step (plain Python: no torch).

Each step fills a token budget (`max_num_batched_tokens`) with at most `max_num_seqs` sequences:
running decodes first (one token each), then running sequences still in prefill, then waiting
requests in queue order (priority, then arrival). Prompts longer than what is left of the budget are
split across steps (chunked prefill), so a long prompt never stalls the others' token streams. When
the KV pool runs out, the most recently admitted running sequence is preempted: its blocks are freed
and it is re-queued to be recomputed (its prefix may still be cached).
"""

import bisect
from dataclasses import dataclass, field

from meridian.errors import UserError
from meridian.worker.engine.block_manager import BlockManager
from meridian.worker.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1, got {getattr(self, name)}")


@dataclass
class ScheduledBatch:
    decodes: list[Sequence] = field(default_factory=list)  # one new token each
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, chunk length)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)

    def singles(self) -> list[tuple[Sequence, "ScheduledBatch"]]:
        """Each sequence of the batch alone, with its share of the work."""
        return [(s, ScheduledBatch(decodes=[s])) for s in self.decodes] + [
            (s, ScheduledBatch(prefills=[(s, n)])) for s, n in self.prefills
        ]

    def without(self, seqs: set[Sequence]) -> "ScheduledBatch":
        return ScheduledBatch(
            [s for s in self.decodes if s not in seqs],
            [(s, n) for s, n in self.prefills if s not in seqs],
        )


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Sequence] = []  # sorted by queue_key()
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0

    def check_admissible(self, seq: Sequence) -> None:
        """Reject at once a request that could never run, instead of letting it wait forever."""
        c, bm = self.config, self.block_manager
        need = seq.num_prompt_tokens + seq.params.max_tokens
        if seq.num_prompt_tokens == 0:
            raise UserError("the prompt is empty")
        if need > c.max_model_len:
            raise UserError(
                f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({seq.params.max_tokens}) "
                f"= {need} exceeds the context length of {c.max_model_len} tokens; shorten the "
                "prompt or lower max_tokens"
            )
        if bm.blocks_needed(need) > bm.num_blocks:
            raise UserError(
                f"prompt + max_tokens = {need} tokens exceeds this worker's KV cache of "
                f"{bm.num_blocks * bm.block_size} tokens; lower max_tokens"
            )
        if not c.enable_chunked_prefill and seq.num_prompt_tokens > c.max_num_batched_tokens:
            raise UserError(
                f"prompt of {seq.num_prompt_tokens} tokens exceeds max_num_batched_tokens "
                f"({c.max_num_batched_tokens}) and chunked prefill is off"
            )

    def add(self, seq: Sequence) -> None:
        self.check_admissible(seq)
        self._enqueue(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        preempted = False
        for seq in [s for s in self.running if not s.in_prefill]:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            while not self.block_manager.can_append(seq):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.append_slot(seq)
                batch.decodes.append(seq)
                budget -= 1
        for seq in [s for s in self.running if s.in_prefill]:
            if budget == 0:
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            batch.prefills.append((seq, n))
            budget -= n
        # Admitting right after a preemption would only hand the freed blocks back and thrash.
        while self.waiting and budget > 0 and not preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            seq = self.waiting[0]
            if not self.config.enable_chunked_prefill and seq.num_tokens > budget:
                break
            if not self.block_manager.can_allocate(seq):
                break
            self.waiting.pop(0)
            self.block_manager.allocate(seq)
            if not seq.admitted_once:
                seq.num_cached_tokens = seq.num_computed_tokens
                seq.admitted_once = True
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            batch.prefills.append((seq, n))
            budget -= n
        return batch

    def on_step_done(self, batch: ScheduledBatch) -> None:
        """The step's K/V are in the cache: advance progress and publish full blocks for reuse."""
        for seq in batch.decodes:
            seq.num_computed_tokens += 1
            self.block_manager.commit(seq)
        for seq, n in batch.prefills:
            seq.num_computed_tokens += n
            self.block_manager.commit(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        self.num_preemptions += 1
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=Sequence.queue_key)
