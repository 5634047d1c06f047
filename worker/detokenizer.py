"""Incremental detokenization with stop strings.

Byte-level BPE splits multi-byte characters across tokens, so text is released only once the
bytes decode cleanly. Text that could still turn into a stop string is held back until it cannot,
so that streamed deltas always add up to the final text.
"""

from meridian.worker.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self._prefix_offset = 0  # decode window start: a few tokens of context for clean bytes
        self._read_offset = 0  # tokens already turned into text
        self.text = ""  # all text so far (up to a stop string, once one is found)
        self._emitted = 0  # chars of text already returned
        self.stopped = False

    def push(self, token_id: int) -> None:
        """Add one generated token; sets `stopped` when a stop string appears."""
        self.ids.append(token_id)
        if not self.stopped:
            self._decode(final=False)

    def _decode(self, final: bool) -> None:
        before = self.tokenizer.decode(self.ids[self._prefix_offset : self._read_offset])
        full = self.tokenizer.decode(self.ids[self._prefix_offset :])
        if full.endswith(_REPLACEMENT) and not final:
            return  # a character is split across tokens; wait for the rest of its bytes
        new = full[len(before) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        search_from = max(0, len(self.text) - self._holdback)
        self.text += new
        found = [at for s in self.stop if (at := self.text.find(s, search_from)) != -1]
        if found:
            self.text = self.text[: min(found)]
            self.stopped = True

    def take(self, final: bool) -> str:
        """Text not returned before; on the last call, everything left."""
        if final and not self.stopped and self._read_offset < len(self.ids):
            self._decode(final=True)
        end = (
            len(self.text)
            if final or self.stopped
            else max(self._emitted, len(self.text) - self._holdback)
        )
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
