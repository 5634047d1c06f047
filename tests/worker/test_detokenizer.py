from meridian.worker.detokenizer import IncrementalDetokenizer


def stream(tokenizer, ids, stop=()):
    d = IncrementalDetokenizer(tokenizer, stop)
    pieces = []
    for t in ids:
        d.push(t)
        pieces.append(d.take(final=False))
        if d.stopped:
            break
    pieces.append(d.take(final=True))
    return pieces, d


def test_streamed_pieces_add_up_to_full_decode(tokenizer):
    text = "naïve café — 日本語のテキスト 🚀🎉 emoji, and code: def f(x): return x**2\n\tdone"
    ids = tokenizer.encode(text)
    pieces, _ = stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)  # multi-byte characters never split


def test_stop_string_truncates_and_is_never_streamed(tokenizer):
    ids = tokenizer.encode("one two three STOP four five")
    pieces, d = stream(tokenizer, ids, stop=("STOP",))
    assert d.stopped
    assert "".join(pieces) == "one two three "
    assert all("ST" not in p for p in pieces)


def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta")
    pieces, _ = stream(tokenizer, ids, stop=("delta", "beta"))
    assert "".join(pieces) == "alpha "


def test_special_tokens_are_not_in_text(tokenizer):
    ids = tokenizer.encode("Paris.") + tokenizer.eos_token_ids
    pieces, _ = stream(tokenizer, ids)
    assert "".join(pieces) == "Paris."
