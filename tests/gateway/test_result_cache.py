"""The result cache: which requests share an answer, and how long and how much is kept."""

import pytest

from meridian.api.v1 import pb
from meridian.gateway.result_cache import ResultCache, cache_key, cacheable


def request(**sampling) -> pb.GenerateRequest:
    sampling = {"temperature": 0.0, "seed": 1, "max_tokens": 16, **sampling}
    return pb.GenerateRequest(
        model="m", text="hello", sampling=pb.SamplingParams(**sampling), request_id="r1"
    )


def answer(text: str, finish=pb.FINISH_REASON_STOP) -> list[pb.GenerateResponse]:
    return [
        pb.GenerateResponse(request_id="r1", token_ids=[1], text=text[:1], model="m"),
        pb.GenerateResponse(request_id="r1", token_ids=[2], text=text[1:], finish_reason=finish),
    ]


def size(key: bytes, responses: list[pb.GenerateResponse]) -> int:
    """What the cache charges: the key plus the responses as stored (request_id cleared)."""
    stored = [pb.GenerateResponse.FromString(r.SerializeToString()) for r in responses]
    for r in stored:
        r.request_id = ""
    return len(key) + sum(len(r.SerializeToString()) for r in stored)


# ---- keys ----------------------------------------------------------------------------------------

SAMPLING_CHANGES = {
    "max_tokens": dict(max_tokens=17),
    "temperature": dict(temperature=0.5),  # still seeded, so still cached
    "top_p": dict(top_p=0.9),
    "top_k": dict(top_k=40),
    "seed": dict(seed=2),
    "stop": dict(stop=["\n"]),
    "stop_token_ids": dict(stop_token_ids=[7]),
    "ignore_eos": dict(ignore_eos=True),
    "logprobs": dict(logprobs=0),  # set-but-zero still returns logprobs
}


@pytest.mark.parametrize("field", sorted(SAMPLING_CHANGES))
def test_every_sampling_parameter_changes_the_key(field):
    assert cache_key(request(**SAMPLING_CHANGES[field])) != cache_key(request())


def test_the_sampling_cases_above_cover_every_sampling_parameter():
    # A new SamplingParams field fails here until it gets a case showing it changes the key.
    assert set(SAMPLING_CHANGES) == {f.name for f in pb.SamplingParams.DESCRIPTOR.fields}


def test_model_and_prompt_change_the_key():
    base = cache_key(request())
    other_model = request()
    other_model.model = "n"
    other_text = request()
    other_text.text = "hello!"
    assert base not in {cache_key(other_model), cache_key(other_text)}


def test_text_token_ids_and_chat_prompts_never_share_a_key():
    text = request()
    ids = request()
    ids.token_ids.ids.extend([104, 101])
    chat = request()
    chat.chat.messages.add(role="user", content="hello")
    keys = {cache_key(text), cache_key(ids), cache_key(chat)}
    assert len(keys) == 3


def test_request_id_priority_and_hops_do_not_change_the_key():
    other = request()
    other.request_id, other.priority, other.hops = "r2", 5, 1
    assert cache_key(other) == cache_key(request())
    assert len(cache_key(other)) == 16


def test_random_requests_have_no_key():
    random = pb.GenerateRequest(model="m", text="hi")  # temperature unset means 1.0
    assert cache_key(random) is None
    random.sampling.temperature = 0.7
    assert cache_key(random) is None


def test_greedy_or_seeded_requests_have_a_key():
    greedy = pb.GenerateRequest(model="m", text="hi", sampling=pb.SamplingParams(temperature=0))
    seeded = pb.GenerateRequest(model="m", text="hi", sampling=pb.SamplingParams(seed=0))
    assert cache_key(greedy) is not None
    assert cache_key(seeded) is not None


# ---- what is stored --------------------------------------------------------------------------


def test_only_complete_answers_are_cacheable():
    assert cacheable(answer("hi", pb.FINISH_REASON_STOP))
    assert cacheable(answer("hi", pb.FINISH_REASON_LENGTH))
    assert not cacheable(answer("hi", pb.FINISH_REASON_ABORT))
    assert not cacheable(answer("hi", pb.FINISH_REASON_UNSPECIFIED))  # stream cut short
    assert not cacheable([])


def test_a_hit_replays_the_stream_without_the_old_request_id():
    cache = ResultCache(max_bytes=10_000, ttl=60)
    key = cache_key(request())
    cache.put(key, answer("hi"), now=0)
    got = cache.get(key, now=1)
    assert [r.text for r in got] == ["h", "i"]
    assert got[-1].finish_reason == pb.FINISH_REASON_STOP
    assert {r.request_id for r in got} == {""}  # the caller stamps the current request's id
    assert cache.get(b"other key", now=1) is None


def test_returned_responses_are_copies():
    cache = ResultCache(max_bytes=10_000, ttl=60)
    key, responses = cache_key(request()), answer("hi")
    cache.put(key, responses, now=0)
    responses[0].text = "changed after put"
    cache.get(key, now=1)[0].text = "changed after get"
    assert cache.get(key, now=2)[0].text == "h"


def test_entries_expire_after_ttl():
    cache = ResultCache(max_bytes=10_000, ttl=60)
    key = cache_key(request())
    cache.put(key, answer("hi"), now=100)
    assert cache.get(key, now=160) is not None  # exactly ttl old: still served
    assert cache.get(key, now=160.5) is None
    assert len(cache) == 0 and cache.bytes == 0  # the expired entry no longer holds memory


def test_least_recently_used_is_evicted_when_bytes_run_out():
    a, b, c = (cache_key(request(seed=s)) for s in (1, 2, 3))
    one = size(a, answer("xx"))
    cache = ResultCache(max_bytes=2 * one, ttl=60)
    cache.put(a, answer("xx"), now=0)
    cache.put(b, answer("yy"), now=0)
    assert cache.bytes == 2 * one
    cache.get(a, now=1)  # a is now more recent than b
    cache.put(c, answer("zz"), now=2)
    assert cache.get(b, now=3) is None
    assert cache.get(a, now=3) is not None and cache.get(c, now=3) is not None
    assert len(cache) == 2 and cache.bytes == 2 * one


def test_a_big_entry_evicts_as_many_as_it_needs():
    keys = [cache_key(request(seed=s)) for s in range(4)]
    one = size(keys[0], answer("xx"))
    cache = ResultCache(max_bytes=3 * one, ttl=60)
    for key in keys[:3]:
        cache.put(key, answer("xx"), now=0)
    cache.put(keys[3], answer("x" * (one + 5)), now=1)
    assert len(cache) == 1 and cache.get(keys[3], now=2) is not None
    assert cache.bytes <= cache.max_bytes


def test_an_entry_bigger_than_the_whole_cache_is_not_stored():
    key = cache_key(request())
    cache = ResultCache(max_bytes=100, ttl=60)
    cache.put(key, answer("x" * 200), now=0)
    assert cache.get(key, now=0) is None
    assert len(cache) == 0 and cache.bytes == 0


def test_putting_the_same_key_again_replaces_the_entry():
    key = cache_key(request())
    cache = ResultCache(max_bytes=10_000, ttl=60)
    cache.put(key, answer("hi"), now=0)
    cache.put(key, answer("ho"), now=1)
    assert [r.text for r in cache.get(key, now=2)] == ["h", "o"]
    assert len(cache) == 1 and cache.bytes == size(key, answer("ho"))


def test_zero_bytes_turns_the_cache_off():
    key = cache_key(request())
    cache = ResultCache(max_bytes=0, ttl=60)
    cache.put(key, answer("hi"), now=0)
    assert cache.get(key, now=0) is None and len(cache) == 0


def test_cache_rejects_nonsense():
    with pytest.raises(ValueError):
        ResultCache(max_bytes=-1, ttl=60)
    with pytest.raises(ValueError):
        ResultCache(max_bytes=100, ttl=0)
