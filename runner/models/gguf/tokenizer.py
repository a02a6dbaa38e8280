"""The tokenizer and chat template a GGUF file carries, as a ``tokenizers.Tokenizer``.

GGUF stores a tokenizer as metadata (``tokenizer.ggml.*``, described in
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): ``model`` (``gpt2`` is a
byte-level BPE), ``tokens`` (the vocabulary, id order), ``merges`` (``"a b"`` strings,
rank order), ``token_type`` (``3`` = control: matched as a whole in text, like
``<|im_start|>``), ``pre`` (the pre-tokenizer's name), the bos / eos ids, and
``tokenizer.chat_template`` (Jinja, as in an HF ``tokenizer_config.json``). The HF
``tokenizers`` library builds the BPE; the pre-tokenizer for each ``pre`` name follows the
``tokenizer.json`` of the model family it names (:data:`PRE_TOKENIZERS`). The chat template
is rendered with ``jinja2`` in a sandbox, the way HF's ``apply_chat_template`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from attnplug.runner.models.gguf.reader import GGUFError, MissingPackageError
from attnplug.runner.models.gguf.reader import field as meta

CONTROL = 3
"""``tokenizer.ggml.token_type`` of a control (special) token (llama.cpp's ``LLAMA_TOKEN_TYPE_CONTROL``)."""

PRE_TOKENIZERS = {
    "default": ("bytelevel",),
    "gpt-2": ("bytelevel",),
    "smollm": ("digits", "bytelevel"),  # SmolLM / SmolLM2 tokenizer.json: Digits(individual), ByteLevel
}
"""``tokenizer.ggml.pre`` -> pre-tokenizer steps; another name falls back to ``default``. (SmolLM2's
vocabulary has no multi-digit token, so there the digits step changes no id; it is kept to
match the model's own ``tokenizer.json``.)"""


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise MissingPackageError("GGUF tokenizers need the tokenizers package: pip install 'attnplug[gguf]'") from None
    return tokenizers


def build_tokenizer(reader, path: str):
    """A ``tokenizers.Tokenizer`` from the file's ``tokenizer.ggml.*`` metadata.

    Raises:
        GGUFError: no tokenizer in the file (``tokenizer.ggml.tokens`` or ``merges``
            missing), or a tokenizer model other than ``gpt2``.
        MissingPackageError: ``tokenizers`` is not installed.
    """
    kind = meta(reader, "tokenizer.ggml.model")
    tokens = meta(reader, "tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise GGUFError(f"{path}: the file carries no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
    if kind != "gpt2":
        raise GGUFError(f"{path}: tokenizer model {kind!r} is not supported (supported: 'gpt2', byte-level BPE)")
    merges = meta(reader, "tokenizer.ggml.merges")
    if merges is None:
        raise GGUFError(f"{path}: the BPE tokenizer has no merges (tokenizer.ggml.merges missing)")
    types = meta(reader, "tokenizer.ggml.token_type") or []
    tk = _tokenizers()
    try:
        bpe = tk.models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                            merges=[tuple(m.split(" ", 1)) for m in merges], ignore_merges=False)
    except Exception as e:  # tokenizers raises a bare Exception for an inconsistent vocabulary
        raise GGUFError(f"{path}: the tokenizer in the file is invalid: {' '.join(str(e).split())[:200]}") from None
    tok = tk.Tokenizer(bpe)
    steps = []
    for step in PRE_TOKENIZERS.get(meta(reader, "tokenizer.ggml.pre", "default"), PRE_TOKENIZERS["default"]):
        steps.append(tk.pre_tokenizers.Digits(individual_digits=True) if step == "digits"
                     else tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    tok.pre_tokenizer = tk.pre_tokenizers.Sequence(steps)
    tok.decoder = tk.decoders.ByteLevel()
    special = [tokens[i] for i, t in enumerate(types) if t == CONTROL]
    tok.add_special_tokens([tk.AddedToken(s, special=True, normalized=False) for s in special])
    return tok


@dataclass
class ChatTokenizer:
    """A tokenizer with the file's chat template and stop token.

    Attributes:
        tokenizer: the ``tokenizers.Tokenizer``.
        chat_template: the Jinja chat template, ``None`` when the file has none.
        bos_token / eos_token: the strings of ``tokenizer.ggml.bos_token_id`` /
            ``eos_token_id`` (given to the template), ``None`` when unset.
        eos_token_id: the id generation stops on, ``None`` when unset.
    """

    tokenizer: Any
    chat_template: str | None
    bos_token: str | None = None
    eos_token: str | None = None
    eos_token_id: int | None = None
    _template: Any = field(default=None, repr=False)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (control tokens written in it are matched whole)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat template applied to ``messages`` (``[{"role", "content"}, ...]``).

        Raises:
            GGUFError: the file has no chat template.
            MissingPackageError: ``jinja2`` is not installed.
        """
        if self.chat_template is None:
            raise GGUFError("the model's GGUF file has no chat template (tokenizer.chat_template)")
        if self._template is None:
            try:
                from jinja2.sandbox import ImmutableSandboxedEnvironment
            except ImportError:
                raise MissingPackageError("chat templates need jinja2: pip install 'attnplug[gguf]'") from None
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            self._template = env.from_string(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of ``messages`` under the chat template, ready for the assistant's turn."""
        return self.encode(self.render_chat(messages))


def chat_tokenizer(tokenizer, chat_template: str | None, bos_id: int | None, eos_id: int | None) -> ChatTokenizer:
    """Wrap a ``tokenizers.Tokenizer`` (see :class:`ChatTokenizer`)."""
    def text(i):
        return tokenizer.id_to_token(int(i)) if i is not None else None

    return ChatTokenizer(tokenizer, chat_template, text(bos_id), text(eos_id), eos_id)


__all__ = ["CONTROL", "ChatTokenizer", "PRE_TOKENIZERS", "build_tokenizer", "chat_tokenizer"]
