import pytest

from meridian.errors import UserError
from meridian.worker.engine.block_manager import BlockManager
from meridian.worker.engine.scheduler import Scheduler, SchedulerConfig
from meridian.worker.engine.sequence import Sequence, SequenceStatus
from meridian.worker.sampling_params import SamplingParams

BS = 4


def make(num_blocks=64, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), BlockManager(num_blocks, BS))


def seq(n_prompt, rid, arrival, max_tokens=8, priority=0):
    # distinct tokens per request, so the prefix cache does not share blocks between them
    tokens = list(range(1000 * arrival, 1000 * arrival + n_prompt))
    return Sequence(rid, tokens, SamplingParams(max_tokens=max_tokens), arrival, priority)


def run_step(s: Scheduler, sampled_token: int = 7):
    """Schedule, pretend the model ran, append a sampled token where a sequence reached its end."""
    batch = s.schedule()
    s.on_step_done(batch)
    done = list(batch.decodes) + [
        q for q, _ in batch.prefills if q.num_computed_tokens == q.num_tokens
    ]
    for q in done:
        q.token_ids.append(sampled_token)
    return batch


def test_decodes_come_before_prefills_in_a_step():
    s = make(max_num_batched_tokens=64)
    a = seq(6, "a", 0)
    s.add(a)
    run_step(s)  # a prefilled, sampled one token
    b = seq(10, "b", 1)
    s.add(b)
    batch = s.schedule()
    assert batch.decodes == [a]
    assert batch.prefills == [(b, 10)]


def test_chunked_prefill_splits_a_long_prompt_across_steps_and_keeps_decodes_going():
    s = make(max_num_batched_tokens=8)
    a = seq(3, "a", 0)
    s.add(a)
    run_step(s)
    long = seq(20, "long", 1)
    s.add(long)
    chunks = []
    for _ in range(3):
        batch = run_step(s)
        assert a in batch.decodes  # the short request's stream never stalls
        chunks += [n for q, n in batch.prefills if q is long]
    assert chunks == [7, 7, 6]
    assert long.num_computed_tokens == 20


def test_token_budget_is_never_exceeded():
    s = make(max_num_batched_tokens=10)
    for i in range(5):
        s.add(seq(7, f"r{i}", i))
    for _ in range(10):
        assert s.schedule().num_tokens <= 10


def test_max_num_seqs_caps_running():
    s = make(max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(4):
        s.add(seq(3, f"r{i}", i))
    batch = s.schedule()
    assert len(batch.prefills) == 2 and len(s.running) == 2 and len(s.waiting) == 2


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    s = make(max_num_batched_tokens=10, enable_chunked_prefill=False)
    s.add(seq(6, "a", 0))
    s.add(seq(6, "b", 1))
    batch = s.schedule()
    assert [(q.request_id, n) for q, n in batch.prefills] == [("a", 6)]


def test_preempts_most_recent_when_blocks_run_out_and_requeues_it_first():
    s = make(num_blocks=4, max_num_batched_tokens=64)
    a, b = seq(4, "a", 0), seq(4, "b", 1)
    s.add(a)
    s.add(b)
    run_step(s)  # both prefilled: 1 block each, 5 tokens each now
    c = seq(4, "c", 2)
    s.add(c)
    run_step(s)  # a, b need a 2nd block each (2 left): fine; c waits (no block)
    assert s.num_preemptions == 0
    assert c.status is SequenceStatus.WAITING
    for _ in range(4):
        run_step(s)  # a, b now at 9 tokens: each needs a 3rd block, none free
    assert s.num_preemptions >= 1
    assert b.status is SequenceStatus.WAITING and a.status is SequenceStatus.RUNNING
    assert s.waiting[0] is b  # ahead of c, which arrived later
    assert b.block_table == [] and b.num_computed_tokens == 0


def test_preempted_sequence_recomputes_its_generated_tokens():
    s = make(num_blocks=3, max_num_batched_tokens=64)
    a, b = seq(4, "a", 0), seq(4, "b", 1)
    s.add(a)
    s.add(b)
    while b.status is not SequenceStatus.WAITING:
        run_step(s)
    generated = b.num_output_tokens
    s.finish(a, "stop")
    batch = s.schedule()
    assert (b, 4 + generated) in batch.prefills


def test_priority_orders_the_waiting_queue():
    s = make(max_num_seqs=1)
    s.add(seq(3, "low", 0, priority=5))
    s.add(seq(3, "high", 1, priority=0))
    s.add(seq(3, "mid", 2, priority=1))
    assert [q.request_id for q in s.waiting] == ["high", "mid", "low"]


@pytest.mark.parametrize(
    ("n_prompt", "max_tokens", "message"),
    [
        (0, 4, "empty"),
        (100, 30, "context length"),
        (60, 10, "KV cache"),
    ],
)
def test_impossible_requests_are_rejected_at_admission(n_prompt, max_tokens, message):
    s = make(num_blocks=16, max_model_len=128)  # pool: 64 tokens
    with pytest.raises(UserError, match=message):
        s.add(seq(n_prompt, "x", 0, max_tokens=max_tokens))
    assert not s.waiting


def test_finish_frees_blocks_of_running_and_drops_waiting():
    s = make(num_blocks=8, max_num_seqs=1)
    a, b = seq(5, "a", 0), seq(5, "b", 1)
    s.add(a)
    s.add(b)
    s.schedule()
    s.finish(a, "abort")
    s.finish(b, "abort")
    assert s.block_manager.num_free_blocks == 8
    assert not s.running and not s.waiting
    assert a.finish_reason == "abort"
