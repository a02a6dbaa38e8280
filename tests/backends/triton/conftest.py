"""Fixtures of the triton backend tests: the kernels run in the Triton interpreter (CPU).

The installed Triton fixes a process's mode at the first ``import triton`` (it decorates
its own device library then; see ``attnplug.backends.triton.runtime``), so
``TRITON_INTERPRET=1`` cannot be set per test. This conftest, loaded at collection before
any test runs, imports triton with the variable set and then restores the environment:
the process stays in interpreter mode (``runtime.interpreting()`` reads the mode from
Triton itself), and subprocesses of other tests do not inherit the variable.

Tests marked ``slow`` (larger interpreter runs: more conformance cases, the split-KV
path through the whole suite, the CLI with its batch-invariance re-runs) are skipped unless
``ATTNPLUG_SLOW=1`` is set or ``-m`` selects them (``pytest -m slow tests/backends/triton``;
the rule is ``tests/conftest.py``'s, for the whole suite).

On a machine with CUDA these CPU tests are skipped (``tests/gpu/`` runs the compiled
kernels there; to run these too: ``TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= pytest
tests/backends/triton``). If triton was already imported in compiled mode before this
conftest, every test here fails with that explanation rather than silently skipping.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch


def _enter_interpreter_mode() -> tuple[str, str] | None:
    """Fix Triton's mode to the interpreter; ``None``, or ``("skip"|"fail", reason)``."""
    if importlib.util.find_spec("triton") is None:
        return "skip", "the triton package is not installed"
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return "skip", ("CUDA is available: tests/gpu/ covers the compiled kernels; run these interpreter tests "
                        "with TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= pytest tests/backends/triton")
    if "triton" not in sys.modules:
        previous = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            import triton  # noqa: F401  (fixes the mode of this process)
        finally:
            if previous is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = previous
    from attnplug.backends.triton.runtime import interpreter_incompatibility, interpreting

    if not interpreting():
        return "fail", ("triton was imported in compiled mode before tests/backends/triton/conftest.py ran; run "
                        "the tests with TRITON_INTERPRET=1 in the environment")
    why = interpreter_incompatibility()
    return None if why is None else ("fail", why)


_MODE_PROBLEM = _enter_interpreter_mode()


@pytest.fixture(autouse=True)
def triton_interpreter(request):
    """Every test here runs its kernels in the Triton interpreter (see the module docstring)."""
    if _MODE_PROBLEM is not None:
        kind, reason = _MODE_PROBLEM
        (pytest.skip if kind == "skip" else pytest.fail)(reason)


def dense_reference(query, keys, values, query_start_loc, seq_lens, scale, *, sliding_window=None,
                    soft_cap=None, causal=True):
    """float64 attention of each request's queries over its dense K/V (no paging).

    ``keys[i]``/``values[i]``: ``[seq_len_i, num_kv_heads, head_size]``; query ``j`` of
    request ``i`` sits at ``seq_len_i - query_len_i + j``. Loops over requests (test code).
    """
    out = torch.zeros(query.shape, dtype=torch.float64)
    group = query.shape[1] // keys[0].shape[1]
    for i in range(len(keys)):
        a, b, n = int(query_start_loc[i]), int(query_start_loc[i + 1]), int(seq_lens[i])
        if a == b:
            continue
        k = keys[i].double().repeat_interleave(group, 1)
        v = values[i].double().repeat_interleave(group, 1)
        s = torch.einsum("thd,nhd->htn", query[a:b].double(), k) * scale
        if soft_cap is not None:
            s = soft_cap * torch.tanh(s / soft_cap)
        pos = torch.arange(n - (b - a), n)[:, None]
        key = torch.arange(n)[None]
        vis = key <= pos if causal else torch.ones(b - a, n, dtype=torch.bool)
        if sliding_window is not None:
            vis &= key > pos - sliding_window
        out[a:b] = torch.einsum("htn,nhd->thd", s.masked_fill(~vis[None], float("-inf")).softmax(-1), v)
    return out


class PagedBatch:
    """A varlen batch over a poisoned paged cache with permuted block ids (CPU).

    Attributes: ``query`` ``[num_tokens, num_heads, head_size]``, ``keys``/``values`` per
    request (dense, ``[seq_len, num_kv_heads, head_size]``), ``kv_cache`` (written),
    ``query_start_loc``/``seq_lens`` int32, ``block_table`` int32, ``slots`` int64 of every
    token of every request, ``scale``.
    """

    def __init__(self, requests, num_heads=4, num_kv_heads=2, head_size=32, block_size=16,
                 dtype=torch.float32, seed=0, poison=1000.0, num_pad_tokens=0, extra_cols=0):
        g = torch.Generator().manual_seed(seed)
        self.requests = list(requests)
        lens = [c + s for c, s in self.requests]
        nblk = [-(-n // block_size) for n in lens]
        num_blocks = 1 + sum(nblk) + 2
        ids = torch.randperm(num_blocks - 1, generator=g) + 1
        self.block_table = torch.zeros(len(lens), max(nblk) + extra_cols, dtype=torch.int32)
        at = 0
        for i, n in enumerate(nblk):
            self.block_table[i, :n] = ids[at:at + n]
            at += n
        self.kv_cache = torch.full((num_blocks, 2, block_size, num_kv_heads, head_size), poison, dtype=dtype)
        self.keys = [torch.randn(n, num_kv_heads, head_size, generator=g).to(dtype) for n in lens]
        self.values = [torch.randn(n, num_kv_heads, head_size, generator=g).to(dtype) for n in lens]
        for i, n in enumerate(lens):
            pos = torch.arange(n)
            blk = self.block_table[i, pos // block_size].long()
            self.kv_cache[blk, 0, pos % block_size] = self.keys[i]
            self.kv_cache[blk, 1, pos % block_size] = self.values[i]
        qlens = torch.tensor([s for _, s in self.requests])
        self.query_start_loc = torch.zeros(len(lens) + 1, dtype=torch.int32)
        self.query_start_loc[1:] = torch.cumsum(qlens, 0).to(torch.int32)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32)
        self.num_actual_tokens = int(qlens.sum())
        self.query = torch.randn(self.num_actual_tokens + num_pad_tokens, num_heads, head_size, generator=g).to(dtype)
        self.max_query_len = int(qlens.max())
        self.block_size = block_size
        self.scale = head_size ** -0.5

    def reference(self, **kw):
        return dense_reference(self.query[:self.num_actual_tokens], self.keys, self.values,
                               self.query_start_loc, self.seq_lens, self.scale, **kw)

    def tiles(self, interpreter=False):
        """The tile sizes a GPU would use (default), or the interpreter's."""
        from attnplug.backends.triton import choose_tiles

        return choose_tiles(self.max_query_len, self.query.shape[1] // self.kv_cache.shape[3], self.query.shape[2],
                            self.query.dtype, interpreter=interpreter)

    def run(self, output=None, **kw):
        """``paged_attention`` over the batch, with the GPU tile sizes unless ``tiles=`` says."""
        from attnplug.backends.triton import paged_attention

        kw.setdefault("tiles", self.tiles())
        out = torch.zeros_like(self.query) if output is None else output
        return paged_attention(self.query, self.kv_cache[:, 0], self.kv_cache[:, 1], out, self.query_start_loc,
                               self.seq_lens, self.block_table, num_reqs=len(self.requests),
                               max_query_len=self.max_query_len, scale=self.scale, **kw)


@pytest.fixture
def paged_batch():
    """``paged_batch(requests, **kw)`` -> :class:`PagedBatch`; requests are
    ``(num_computed_tokens, num_scheduled_tokens)`` pairs."""
    return PagedBatch
