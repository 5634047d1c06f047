"""How a scheduled step runs: build the flat batch, run the model once, sample.

Owns the model, the KV cache tensors and the per-request RNGs. The scheduler decides *what* runs;
this decides *how*.
"""

import logging

import torch

from meridian.worker.engine.scheduler import ScheduledBatch
from meridian.worker.engine.sequence import Sequence
from meridian.worker.layers.attention import AttentionBatch, PrefillChunk
from meridian.worker.layers.sampler import SampleResult, sample
from meridian.worker.loaders import Checkpoint
from meridian.worker.models import build_model

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        checkpoint: Checkpoint,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        kv_cache_memory: float | None,
    ):
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.config = checkpoint.config
        self.model = build_model(checkpoint, dtype, device)
        self.num_blocks = self._num_blocks(kv_cache_memory)
        cfg = self.config
        slots = self.num_blocks * block_size
        # [layers, K/V, slots, kv_heads, head_dim]
        self.kv_cache = torch.zeros(
            cfg.num_layers, 2, slots, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device
        )
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_cache]
        log.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB)",
            self.num_blocks,
            block_size,
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**30,
        )

    def _num_blocks(self, kv_cache_memory: float | None) -> int:
        """Blocks that fit the budget: bytes when > 1, else a fraction of free device memory."""
        per_block = self.config.kv_bytes_per_token(self.dtype.itemsize) * self.block_size
        if kv_cache_memory is None:
            kv_cache_memory = 0.9 if self.device.type == "cuda" else float(2**30)
        if kv_cache_memory <= 1:
            free = (
                torch.cuda.mem_get_info(self.device)[0]
                if self.device.type == "cuda"
                else _available_host_memory()
            )
            kv_cache_memory = free * kv_cache_memory
        return max(1, int(kv_cache_memory // per_block))

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], SampleResult]:
        """Run one step; returns the sequences that sample this step and their samples."""
        input_ids, positions, attn, sample_rows, samplers = self._prepare(batch)
        hidden = self.model(input_ids, positions, attn, self.kv_caches)
        logits = self.model.compute_logits(hidden[sample_rows])
        generators = [self._generator(s) for s in samplers]
        # A failed step is run again (LLMEngine.step): it must draw the same noise the second time.
        states = [(g, g.get_state()) for g in generators if g is not None]  # ~1 µs each
        try:
            result = sample(logits.cpu(), [s.params for s in samplers], generators)
        except Exception:
            for g, state in states:
                g.set_state(state)
            raise
        return samplers, result

    def _prepare(self, batch: ScheduledBatch):
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        samplers: list[Sequence] = []
        for seq in batch.decodes:
            sample_rows.append(len(tokens))
            samplers.append(seq)
            tokens.append(seq.token_ids[-1])
            positions.append(seq.num_tokens - 1)
        chunks = []
        for seq, n in batch.prefills:
            start = len(tokens)
            first = seq.num_computed_tokens
            tokens.extend(seq.token_ids[first : first + n])
            positions.extend(range(first, first + n))
            context = None
            if first > 0:
                context = torch.tensor(seq.block_table[: -(-(first + n) // bs)])
            chunks.append(PrefillChunk(start, start + n, first, context))
            if first + n == seq.num_tokens:
                sample_rows.append(start + n - 1)
                samplers.append(seq)
        pos = torch.tensor(positions)
        table = self._block_tables(
            [s.block_table for s in batch.decodes] + [s.block_table for s, _ in batch.prefills]
        )
        owners = [i for i, _ in enumerate(batch.decodes)]
        owners += [
            len(batch.decodes) + i for i, (_, n) in enumerate(batch.prefills) for _ in range(n)
        ]
        owner = torch.tensor(owners)
        slot_mapping = table[owner, pos // bs] * bs + pos % bs
        attn = AttentionBatch(
            slot_mapping=slot_mapping.to(self.device), block_size=bs, prefills=chunks
        )
        if batch.decodes:
            n = len(batch.decodes)
            lens = torch.tensor([s.num_tokens for s in batch.decodes])  # [B]
            width = -(-int(lens.max()) // bs)  # blocks of the longest context
            span = torch.arange(width * bs)
            attn.num_decodes = n
            attn.decode_blocks = table[:n, :width].to(self.device)  # [B, N]
            attn.decode_mask = (span.unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :].to(
                self.device
            )
        for c in chunks:
            if c.context_blocks is not None:
                c.context_blocks = c.context_blocks.to(self.device)
        return (
            torch.tensor(tokens, device=self.device),
            pos.to(self.device),
            attn,
            torch.tensor(sample_rows, dtype=torch.long, device=self.device),
            samplers,
        )

    @staticmethod
    def _block_tables(tables: list[list[int]]) -> torch.Tensor:
        width = max(len(t) for t in tables)
        return torch.tensor([t + [0] * (width - len(t)) for t in tables])  # [S, max_blocks]

    @staticmethod
    def _generator(seq: Sequence) -> torch.Generator | None:
        if seq.params.seed is None or seq.params.greedy:
            return None
        if seq.sampler_state is None:
            seq.sampler_state = torch.Generator().manual_seed(seq.params.seed)
        return seq.sampler_state


def _available_host_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")
