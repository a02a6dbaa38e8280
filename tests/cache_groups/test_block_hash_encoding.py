"""The block-hash chain (cache_groups/block_hash.py) byte for byte: each digest is rebuilt
here from the documented canonical encoding (tag, parent, salt, token count, little-endian
int64 tokens, key count, type-tagged keys), and each refusal is compared word for word."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from attnplug.cache_groups.block_hash import hash_block_tokens, hash_request_tokens
from attnplug.core.errors import SchedulingError


def u64(n: int) -> bytes:
    return n.to_bytes(8, "big")


def key(k) -> bytes:
    if isinstance(k, int):
        raw, tag = str(k).encode(), b"i"
    elif isinstance(k, str):
        raw, tag = k.encode("utf-8"), b"s"
    else:
        raw, tag = k, b"b"
    return tag + u64(len(raw)) + raw


def expected(parent, tokens, keys=(), salt=None) -> bytes:
    raw = b"attnplug-block-hash-v1"
    raw += b"\x00" if parent is None else b"\x01" + parent
    raw += b"\x00" if salt is None else b"\x01" + key(salt)
    raw += u64(len(tokens)) + b"".join(t.to_bytes(8, "little") for t in tokens)
    raw += u64(len(keys)) + b"".join(key(k) for k in keys)
    return hashlib.sha256(raw).digest()


@pytest.mark.parametrize("keys, salt", [
    ((), "salé"), ((), b"\x00s"), ((), 7), ((-12, "lora-é", b"\xff"), None), ((0,), "x"),
])
def test_one_block_digest_is_the_documented_encoding(keys, salt):
    toks = [0, 1, 2**40, 2**63 - 1]
    assert hash_block_tokens(None, toks, keys, salt) == expected(None, toks, keys, salt)
    assert hash_block_tokens(None, np.array(toks, dtype=np.uint64), keys, salt) == expected(None, toks, keys, salt)
    parent = hashlib.sha256(b"p").digest()
    assert hash_block_tokens(parent, toks[:1], keys) == expected(parent, toks[:1], keys)


def test_the_chain_salts_block_zero_and_chains_every_later_block():
    toks, B = [5, 6, 7, 8, 9, 10, 11], 3
    keys = [("a",), (2,), ()]
    b0 = expected(None, toks[0:3], keys[0], "s")
    b1 = expected(b0, toks[3:6], keys[1])
    assert hash_request_tokens(toks, B, "s", extra_keys=keys) == [b0, b1]
    assert hash_request_tokens(toks, B, "s", prev_block_hashes=[b0], extra_keys=keys) == [b0, b1]
    assert hash_request_tokens(toks, B, "s", prev_block_hashes=[b0, b1]) == [b0, b1]
    assert hash_request_tokens(toks, 1) == hash_request_tokens(toks, 1, None, ())
    chain1 = hash_request_tokens(toks, 1)
    h = None
    for i, t in enumerate(toks):
        h = expected(h, [t])
        assert chain1[i] == h
    assert hash_request_tokens(toks[:2], 3) == [] and hash_request_tokens(toks, 7) == [expected(None, toks)]


def refused(call, msg):
    with pytest.raises(SchedulingError) as e:
        call()
    assert str(e.value) == msg


def test_refusals_word_for_word():
    root = hash_block_tokens(None, [1])
    refused(lambda: hash_block_tokens(b"short", [1]),
            "parent_block_hash must be a 32-byte sha256 digest, got b'short'")
    refused(lambda: hash_block_tokens("x" * 32, [1]),
            f"parent_block_hash must be a 32-byte sha256 digest, got {'x' * 32!r}")
    refused(lambda: hash_block_tokens(root, [1], cache_salt="s"),
            "cache_salt belongs to block 0 only (parent_block_hash=None); "
            "later blocks inherit it through the chain")
    for bad in ([], [[1, 2]], [1.5], ["a"]):
        refused(lambda: hash_block_tokens(None, bad),
                f"token_ids must be a non-empty 1-D sequence of ints, got {bad!r}")
    refused(lambda: hash_block_tokens(None, [3, -4, -5]), "token ids must be >= 0, got -4")
    refused(lambda: hash_block_tokens(None, [1], (1.5,)),
            "an extra key (or cache salt) must be int, str or bytes, got float 1.5")
    refused(lambda: hash_block_tokens(None, [1], (True,)),
            "an extra key (or cache salt) must be int, str or bytes, got bool True")
    refused(lambda: hash_block_tokens(None, [1], cache_salt=None or 2.5),
            "an extra key (or cache salt) must be int, str or bytes, got float 2.5")
    for bad in (0, -1, True, 2.0):
        refused(lambda: hash_request_tokens([1, 2], bad), f"block_size must be a positive int, got {bad!r}")
    refused(lambda: hash_request_tokens([1, 2, 3], 2, prev_block_hashes=[root, root]),
            "2 previous block hashes but only 1 full blocks in 3 tokens of block size 2")
    refused(lambda: hash_request_tokens([1, 2, 3, 4], 2, extra_keys=[()]),
            "extra_keys has 1 entries for 2 full blocks")
    assert len(hash_request_tokens([1, 2, 3, 4], 2, extra_keys=[(), ()])) == 2  # exactly enough
