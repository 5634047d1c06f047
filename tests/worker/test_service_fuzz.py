"""Any GenerateRequest the wire can carry gets an answer or a client error from a real worker, never
an internal error or a hang, and leaves nothing behind: random field values within and beyond
what each field's type allows, up to three requests at once (so good and bad ones share steps)."""

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from in_process_worker import MODEL, InProcessWorker, small_engine

from meridian.api.v1 import pb

ANSWERED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
VOCAB = 49152

u32 = st.integers(0, 2**32 - 1)
doubles = st.floats(allow_nan=True, allow_infinity=True)  # NaN, ±inf, huge, subnormal
texts = st.text(st.characters(codec="utf-8"), max_size=40)  # protobuf strings are UTF-8
long_texts = st.text(st.characters(codec="utf-8"), min_size=250, max_size=300)


def optional(strategy):
    return st.none() | strategy


def mostly(valid, other):
    """`valid` nine times in ten, else `other` (what the worker must refuse, or anything)."""
    return st.integers(0, 9).flatmap(lambda i: other if i == 0 else valid)


@st.composite
def sampling_params(draw) -> pb.SamplingParams:
    fields = {
        "max_tokens": draw(mostly(st.integers(1, 4), optional(u32))),  # unset: up to ~30 tokens
        "temperature": draw(mostly(optional(st.floats(0, 2)), doubles)),
        "top_p": draw(mostly(optional(st.floats(0, 1, exclude_min=True)), doubles)),
        "top_k": draw(u32),
        "seed": draw(optional(st.integers(-(2**63), 2**63 - 1))),
        "stop": draw(mostly(st.lists(texts, max_size=3), st.lists(long_texts, max_size=20))),
        "stop_token_ids": draw(st.lists(mostly(st.integers(0, VOCAB - 1), u32), max_size=4)),
        "ignore_eos": draw(st.booleans()),
        "logprobs": draw(mostly(optional(st.integers(0, 20)), u32)),
    }
    return pb.SamplingParams(**{k: v for k, v in fields.items() if v is not None})


messages = st.builds(
    pb.ChatMessage,
    role=mostly(st.sampled_from(["system", "user", "assistant"]), texts),
    content=texts,
    name=mostly(st.just(""), texts),
)
prompts = mostly(
    st.one_of(
        st.builds(lambda text: {"text": text}, texts),
        st.builds(
            lambda ids: {"token_ids": pb.TokenIds(ids=ids)},
            st.lists(mostly(st.integers(0, VOCAB - 1), u32), max_size=40),
        ),
        st.builds(lambda m: {"chat": pb.Chat(messages=m)}, st.lists(messages, max_size=2)),
    ),
    st.just({}),  # no prompt at all
)
requests = st.builds(
    lambda prompt, **fields: pb.GenerateRequest(**prompt, **fields),
    prompts,
    model=mostly(st.sampled_from(["", MODEL]), texts),
    sampling=sampling_params(),
    request_id=texts,
    priority=st.integers(-(2**31), 2**31 - 1),
    hops=u32,
)


@pytest.fixture(scope="module")
def worker(checkpoint):
    w = InProcessWorker(small_engine(checkpoint, max_model_len=32))
    yield w
    w.close()


def status(worker: InProcessWorker, request: pb.GenerateRequest) -> grpc.StatusCode:
    try:
        for _ in worker.stub.Generate(request, timeout=60):
            pass
    except grpc.RpcError as e:
        assert e.code() in ANSWERED, (e.code(), e.details(), request)
        return e.code()
    return grpc.StatusCode.OK


@pytest.mark.timeout(300)  # about 40 s on two cores
@settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(batch=st.lists(requests, min_size=1, max_size=3))
def test_every_request_ends_answered_or_refused_and_leaves_nothing_behind(worker, batch):
    with ThreadPoolExecutor(len(batch)) as pool:
        for code in pool.map(lambda r: status(worker, r), batch):
            event(code.name)  # --hypothesis-show-statistics shows the mix
    worker.wait_idle()
