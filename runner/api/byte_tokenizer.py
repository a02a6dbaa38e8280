"""A tokenizer for random-weight models: one token per UTF-8 byte, plus a chat template.

The presets (``runner/models/presets.py``) have no tokenizer of their own, yet a server
speaks text. This one is byte-level BPE without merges, built with the ``tokenizers``
library the real-weight path uses (``runner/models/gguf/tokenizer.py``): ids ``0..255``
are the 256 bytes in GPT-2's byte-to-unicode order (``ByteLevel.alphabet()``, sorted),
``256`` is ``<|im_start|>`` and ``257`` is ``<|im_end|>`` (the end-of-sequence token),
ids ``258 .. vocab_size - 1`` are the added tokens ``<|extra_N|>`` (so every id a random
model samples has text, and that text encodes back to it), and the chat template is ChatML
(the format SmolLM2's own template writes). Any text round-trips.
"""

from __future__ import annotations

from attnplug.runner.models.gguf.tokenizer import ChatTokenizer, chat_tokenizer

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML: ``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`` per message, then the assistant's header."""

SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>")
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
"""The smallest model vocabulary this tokenizer fits."""


def byte_tokenizer(vocab_size: int = MIN_VOCAB_SIZE) -> ChatTokenizer:
    """The byte-level :class:`ChatTokenizer` of a model of ``vocab_size`` ids (module
    docstring); EOS is ``<|im_end|>`` (257).

    Raises:
        MissingPackageError: ``tokenizers`` or ``jinja2`` is missing (``attnplug[gguf]``).
    """
    from attnplug.runner.models.gguf.tokenizer import _tokenizers

    tk = _tokenizers()
    alphabet = sorted(tk.pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tk.decoders.ByteLevel()
    tok.add_special_tokens([tk.AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    tok.add_tokens([tk.AddedToken(f"<|extra_{i}|>", special=False, normalized=False)
                    for i in range(MIN_VOCAB_SIZE, vocab_size)])
    return chat_tokenizer(tok, CHATML_TEMPLATE, tok.token_to_id(SPECIAL_TOKENS[0]), tok.token_to_id(SPECIAL_TOKENS[1]))


__all__ = ["CHATML_TEMPLATE", "MIN_VOCAB_SIZE", "SPECIAL_TOKENS", "byte_tokenizer"]
