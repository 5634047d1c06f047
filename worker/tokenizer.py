"""Text <-> token ids, and chat prompts rendered with the model's own template.

Built with the `tokenizers` library: from a GGUF file's vocabulary, merges and token types, or from
an HF folder's `tokenizer.json`. Chat templates are rendered with jinja2 the way Hugging Face does.
"""

import functools
import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as FastTokenizer

from meridian.errors import UserError

# GGUF token types (llama.cpp's llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4

# Pre-tokenizer splits for `tokenizer.ggml.pre` values whose merges were learned on a split other
# than GPT-2's; anything unlisted uses GPT-2's (ByteLevel's built-in regex).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT}
CHAT_ROLES = ("system", "user", "assistant")


class PromptTooLong(UserError):
    """The prompt certainly has more tokens than allowed, as told from its length alone."""


class Tokenizer:
    def __init__(
        self,
        fast: FastTokenizer,
        eos_token_ids: list[int],
        bos_token_id: int | None,
        add_bos: bool,
        chat_template: str | None,
    ):
        self.fast = fast
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.vocab_size = fast.get_vocab_size(with_added_tokens=True)
        added = fast.get_added_tokens_decoder()
        self.special_token_ids = frozenset(i for i, tok in added.items() if tok.special)

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "Tokenizer":
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise UserError(
                f"GGUF tokenizer type {kind!r} is not supported (supported: 'gpt2' byte-level BPE)"
            )
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        alphabet = set(pre_tokenizers.ByteLevel.alphabet())
        vocab = {tok: i for i, tok in enumerate(tokens)}
        try:
            bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False)
        except Exception as e:  # the tokenizers library raises a bare Exception
            raise UserError(f"the GGUF file's tokenizer is inconsistent: {e}") from e
        fast = FastTokenizer(bpe)
        split = _PRE_SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
        if split:
            fast.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        else:
            fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        fast.decoder = decoders.ByteLevel()
        # Control tokens (`<|im_start|>`) must match whole wherever they appear in text. A control
        # token spelled outside the byte alphabet is a converter mislabel and is left alone.
        fast.add_special_tokens(
            [
                AddedToken(tok, special=True, normalized=False)
                for tok, kind in zip(tokens, types, strict=True)
                if kind == _CONTROL and set(tok) <= alphabet
            ]
        )
        fast.add_tokens(
            [
                AddedToken(tok, special=False, normalized=False)
                for tok, kind in zip(tokens, types, strict=True)
                if kind == _USER_DEFINED
            ]
        )
        eos = meta.get("tokenizer.ggml.eos_token_id")
        bos = meta.get("tokenizer.ggml.bos_token_id")
        return cls(
            fast,
            eos_token_ids=[int(eos)] if eos is not None else [],
            bos_token_id=int(bos) if bos is not None else None,
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_folder(cls, folder: Path, model_eos: list[int]) -> "Tokenizer":
        path = folder / "tokenizer.json"
        if not path.exists():
            raise UserError(
                f"{folder} has no tokenizer.json; Meridian needs the fast tokenizer file"
            )
        fast = FastTokenizer.from_file(str(path))
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template = cfg.get("chat_template")
        template_file = folder / "chat_template.jinja"
        if template is None and template_file.exists():
            template = template_file.read_text()
        eos = list(model_eos)
        eos_token = _token_text(cfg.get("eos_token"))
        if eos_token is not None and fast.token_to_id(eos_token) is not None:
            eos.append(fast.token_to_id(eos_token))
        bos_token = _token_text(cfg.get("bos_token"))
        bos = fast.token_to_id(bos_token) if bos_token else None
        return cls(
            fast,
            eos_token_ids=sorted(set(eos)),
            bos_token_id=bos,
            # tokenizer.json's post-processor already adds BOS where the model wants it.
            add_bos=False,
            chat_template=template,
        )

    @classmethod
    def from_pb(cls, r) -> "Tokenizer":
        """The tokenizer a worker described in a pb.TokenizerResponse (how a gateway gets one)."""
        return cls(
            FastTokenizer.from_str(r.tokenizer_json),
            eos_token_ids=list(r.eos_token_ids),
            bos_token_id=r.bos_token_id if r.HasField("bos_token_id") else None,
            add_bos=r.add_bos,
            chat_template=r.chat_template or None,
        )

    def to_pb(self, model: str):
        from meridian.api.v1 import pb

        r = pb.TokenizerResponse(
            model=model,
            tokenizer_json=self.fast.to_str(),
            chat_template=self.chat_template or "",
            add_bos=self.add_bos,
            eos_token_ids=self.eos_token_ids,
        )
        if self.bos_token_id is not None:
            r.bos_token_id = self.bos_token_id
        return r

    # ---- use ----------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.fast.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.fast.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text on its own (special tokens spelled out); "" for an id past the
        vocabulary (models may pad their embeddings)."""
        texts = self._token_texts
        return texts[token_id] if token_id < len(texts) else ""

    @functools.cached_property
    def _token_texts(self) -> tuple[str, ...]:
        # Once for the whole vocabulary (~0.1 s for 50k tokens), so no reply decodes per token.
        return tuple(
            self.fast.decode([i], skip_special_tokens=False) for i in range(self.vocab_size)
        )

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """The most prompt bytes one token stands for: the longest token's UTF-8 text (a partial
        character decodes to U+FFFD, which is longer than the bytes it replaces). None when no such
        bound holds: a tokenizer that normalizes text first, is not byte-level, or has added
        tokens that swallow the whitespace around them."""
        byte_level = isinstance(self.fast.decoder, decoders.ByteLevel)
        stripping = any(t.lstrip or t.rstrip for t in self.fast.get_added_tokens_decoder().values())
        if self.fast.normalizer is not None or not byte_level or stripping:
            return None
        return max(len(text.encode()) for text in self._token_texts)

    def check_length(self, text: str, limit: int) -> None:
        """Raise PromptTooLong when `text` certainly encodes to more than `limit` tokens, from its
        UTF-8 length alone (without tokenizing it)."""
        if self.max_token_bytes is None or len(text) * 4 <= limit * self.max_token_bytes:
            return  # 4: the most bytes a character takes in UTF-8
        size = len(text.encode())
        if size > limit * self.max_token_bytes:
            raise PromptTooLong(f"the prompt ({size} bytes) has more than {limit} tokens")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages`, rendered by the model's own template."""
        if not self.chat_template:
            raise UserError("this model has no chat template; send a plain prompt instead")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise UserError("each chat message needs a 'role' and a 'content'")
        if any("name" in m for m in messages):
            self._check_names_rendered(messages, add_generation_prompt)
        return self._render(messages, add_generation_prompt)

    def _check_names_rendered(self, messages: list[dict], add_generation_prompt: bool) -> None:
        # A template that never writes a name would drop it silently: render each name as a probe
        # (private-use characters no text has) and refuse the names it leaves out.
        probes = [
            {**m, "name": f"\ue000{i}\ue000"} if "name" in m else m for i, m in enumerate(messages)
        ]
        text = self._render(probes, add_generation_prompt)
        if any("name" in m and m["name"] not in text for m in probes):
            raise UserError(
                "this model's chat template has no place for a message's name; leave it out"
            )

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        special = {
            name: self.fast.id_to_token(i) if i is not None else ""
            for name, i in (
                ("bos_token", self.bos_token_id),
                ("eos_token", self.eos_token_ids[0] if self.eos_token_ids else None),
            )
        }
        try:
            return _compile(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **special
            )
        except jinja2.TemplateError as e:
            raise UserError(f"the model's chat template failed on these messages: {e}") from e


def prompt_token_ids(tokenizer: Tokenizer, request, limit: int | None = None) -> list[int]:
    """The token ids of a pb.GenerateRequest's prompt: the same on a worker and on a gateway. With
    a `limit`, a text (or rendered conversation) that certainly has more tokens raises
    PromptTooLong before it is tokenized."""
    kind = request.WhichOneof("prompt")
    if kind == "token_ids":
        ids = list(request.token_ids.ids)
    elif kind in ("text", "chat"):
        text = request.text if kind == "text" else tokenizer.apply_chat_template(_messages(request))
        if limit is not None:
            tokenizer.check_length(text, limit)
        # A chat template writes any BOS itself, as Hugging Face's apply_chat_template does.
        ids = tokenizer.encode(text, add_special_tokens=kind == "text")
    else:
        raise UserError("the request has no prompt: set text, token_ids or chat")
    if not ids:
        raise UserError("the prompt is empty")
    return ids


def _messages(request) -> list[dict]:
    messages = []
    for i, m in enumerate(request.chat.messages):
        if m.role not in CHAT_ROLES:
            raise UserError(
                f"message {i} has role {m.role!r}; a role is one of {', '.join(CHAT_ROLES)}"
            )
        messages.append(
            {"role": m.role, "content": m.content} | ({"name": m.name} if m.name else {})
        )
    if not messages:
        raise UserError("the conversation has no messages")
    return messages


def _token_text(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _raise(message: str):
    raise jinja2.TemplateError(message)


_TEMPLATES: dict[str, jinja2.Template] = {}


def _compile(source: str) -> jinja2.Template:
    """Compile once, in the sandboxed environment and with the helpers HF templates expect."""
    if source not in _TEMPLATES:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]
