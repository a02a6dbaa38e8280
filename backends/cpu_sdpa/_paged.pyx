# cython: language_level=3, boundscheck=False, wraparound=False
"""Paged attention for the CPU that reads K/V in place through the block table.

One call attends every query row of a set of requests (decodes, speculative rows,
prefills and chunked-prefill continuations alike: varlen, bottom-right causal over the
request's cached context): no gather, no padding, no mask. A work item is a request (or,
with fewer requests than twice the threads, a request's KV head): it walks the request's
keys once, in chunks of ``AP_CHUNK`` (128), for all the query rows that read them (query tokens
times query heads, in tiles of ``AP_ROWS``; each key token's ``H_kv * D`` K and V rows are
contiguous), with an online softmax in float32 (running max ``m``, running sum ``l``,
rescaled accumulator). The loops run 16 float lanes wide on an AVX-512 CPU for head sizes
that are multiples of 16, 8 otherwise (``vector_lanes``); head sizes 32, 64 and 128 have
their own compiled functions. Items run on OpenMP threads when the module was built with it.
Only keys from the request's first query row's window start to ``seq_len - 1`` are read (a
row's unseen keys inside that span: K read, logit masked to ``-inf``, V not read), so a
poisoned or recycled block past ``seq_len`` or before the window cannot leak in; a NaN logit
or value a row does see makes the row NaN (as ``torch_native``). ``ap_check`` bounds the
metadata against the tensors before ``ap_run`` reads anything.

The C is in four parts, in this order: this file's shared definitions (the argument
struct, the tile sizes, the target attributes), ``_paged_lanes.pxi`` (bf16 conversions, the
vectorizable exp, 8- and 16-lane helpers), ``_paged_item.pxi`` (one work item, as macros)
and ``_paged_run.pxi`` (the items per dtype and head size, ``ap_run``, ``ap_check``).

The Python-facing wrapper is ``backends/cpu_sdpa/paged.py`` (validation, strides); this
module takes raw addresses and strides and trusts them.
"""

from libc.stdint cimport int32_t, int64_t, uintptr_t

cdef extern from *:
    """
    #include <math.h>
    #include <stdint.h>
    #include <string.h>
    #ifdef _OPENMP
    #include <omp.h>
    #endif

    #define AP_ROWS 32      /* query rows (token x query head) per tile */
    #define AP_CHUNK 128    /* keys per online-softmax step */
    #define AP_DMAX 256     /* the largest head size */

    typedef struct {
        void *out; int64_t out_tok, out_head;
        const void *q; int64_t q_tok, q_head;
        const void *kv; int64_t kv_blk, kv_half, kv_tok, kv_head;
        const int32_t *block_table; int64_t bt_row;
        const int32_t *qsl; const int32_t *seq_lens;
        const int64_t *reqs; int64_t n_reqs;
        int num_heads, num_kv_heads, head_size, block_size, head_splits;
        float scale; int window; float softcap; int causal;
    } ap_args;

    #if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
    #define AP_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
    #define AP_V4 __attribute__((target("arch=x86-64-v4")))
    #define AP_HAVE_W16 1
    #else
    #define AP_CLONES
    #define AP_HAVE_W16 0
    #endif

    """
    int AP_ROWS  # (a declaration: an extern block needs one)

include "_paged_lanes.pxi"
include "_paged_item.pxi"
include "_paged_run.pxi"

cdef extern from *:
    ctypedef struct ap_args:
        void *out
        int64_t out_tok, out_head
        const void *q
        int64_t q_tok, q_head
        const void *kv
        int64_t kv_blk, kv_half, kv_tok, kv_head
        const int32_t *block_table
        int64_t bt_row
        const int32_t *qsl
        const int32_t *seq_lens
        const int64_t *reqs
        int64_t n_reqs
        int num_heads, num_kv_heads, head_size, block_size, head_splits
        float scale
        int window
        float softcap
        int causal
    int ap_run(const ap_args *a, int dtype, int num_threads) nogil
    int ap_check(const ap_args *a, int64_t num_tokens, int64_t num_qsl, int64_t num_seq, int64_t bt_rows,
                 int64_t bt_cols, int64_t num_blocks, int64_t *bad_req, int64_t *bad_val) nogil
    int ap_openmp()
    int ap_lanes(int head_size)
    void ap_set_force_w8(int on)
    int AP_DMAX
    int AP_HAVE_F16


MAX_HEAD_SIZE = AP_DMAX
"""The largest head size the kernel takes (its per-row accumulators live on the stack)."""

HAS_FLOAT16 = bool(AP_HAVE_F16)
"""float16 is compiled in (the C compiler has ``_Float16``)."""

OPENMP = bool(ap_openmp())
"""Built with OpenMP: ``num_threads > 1`` splits the ``(request, KV head)`` pairs."""


def vector_lanes(int head_size):
    """The vector width (float lanes, 16 or 8) the kernel's loops run at for ``head_size``:
    16 where the CPU has AVX-512 (F, BW, DQ, VL) and ``head_size`` is a multiple of 16, else 8."""
    return ap_lanes(head_size)


def _force_8_lanes(bint on):
    """Tests only: run the 8-lane functions even where the 16-lane ones would run
    (process-wide; not thread-safe against concurrent calls)."""
    ap_set_force_w8(on)


cdef inline void _set_metadata(ap_args *a, uintptr_t block_table, int64_t bt_row, uintptr_t query_start_loc,
                               uintptr_t seq_lens, uintptr_t reqs, int64_t n_reqs) noexcept:
    """The per-step metadata fields ``paged_attention`` and ``check_metadata`` share."""
    a.block_table = <const int32_t *> block_table
    a.bt_row = bt_row
    a.qsl = <const int32_t *> query_start_loc
    a.seq_lens = <const int32_t *> seq_lens
    a.reqs = <const int64_t *> reqs
    a.n_reqs = n_reqs


def paged_attention(uintptr_t out, int64_t out_tok, int64_t out_head,
                    uintptr_t q, int64_t q_tok, int64_t q_head,
                    uintptr_t kv, int64_t kv_blk, int64_t kv_half, int64_t kv_tok, int64_t kv_head,
                    uintptr_t block_table, int64_t bt_row, uintptr_t query_start_loc, uintptr_t seq_lens,
                    uintptr_t reqs, int64_t n_reqs, int num_heads, int num_kv_heads, int head_size,
                    int block_size, float scale, int window, float softcap, bint causal, int dtype,
                    int num_threads, int64_t num_tokens, int64_t num_qsl, int64_t num_seq, int64_t bt_rows,
                    int64_t bt_cols, int64_t num_blocks):
    """Raw entry point (addresses and element strides; ``paged.py`` checks the tensors).
    The extents (``num_tokens`` query/out rows, ``num_qsl`` / ``num_seq`` entries of
    ``query_start_loc`` / ``seq_lens``, the block table's ``bt_rows`` x ``bt_cols``, the
    cache's ``num_blocks``) bound the metadata, checked in C before any K/V read (request
    indices, ``query_start_loc`` within ``num_tokens`` and non-decreasing, ``0 <=
    query_len <= seq_len``, the block-table columns the rows read and their block ids).
    Runs without the GIL. Returns ``None``, or a message naming the first request whose
    metadata fails (nothing was read or written). Raises ``ValueError`` for an
    unsupported ``dtype`` code."""
    cdef ap_args a
    cdef int rc
    cdef int64_t bad_req = 0, bad_val = 0
    a.out = <void *> out
    a.out_tok = out_tok
    a.out_head = out_head
    a.q = <const void *> q
    a.q_tok = q_tok
    a.q_head = q_head
    a.kv = <const void *> kv
    a.kv_blk = kv_blk
    a.kv_half = kv_half
    a.kv_tok = kv_tok
    a.kv_head = kv_head
    _set_metadata(&a, block_table, bt_row, query_start_loc, seq_lens, reqs, n_reqs)
    a.num_heads = num_heads
    a.num_kv_heads = num_kv_heads
    a.head_size = head_size
    a.block_size = block_size
    a.scale = scale
    a.window = window
    a.softcap = softcap
    a.causal = causal
    with nogil:
        rc = ap_check(&a, num_tokens, num_qsl, num_seq, bt_rows, bt_cols, num_blocks, &bad_req, &bad_val)
        if rc == 0:
            rc = ap_run(&a, dtype, num_threads)
        else:
            rc = -1 - rc
    if rc == -1:
        raise ValueError(f"paged_attention: unsupported dtype code {dtype}")
    if rc < -1:
        return _message(-2 - rc, bad_req, bad_val, num_tokens, num_qsl, num_seq, bt_rows, bt_cols, num_blocks,
                        block_size)
    return None


def check_metadata(uintptr_t block_table, int64_t bt_row, uintptr_t query_start_loc, uintptr_t seq_lens,
                   uintptr_t reqs, int64_t n_reqs, int block_size, int window, bint causal, int64_t num_tokens,
                   int64_t num_qsl, int64_t num_seq, int64_t bt_rows, int64_t bt_cols, int64_t num_blocks):
    """``paged_attention``'s metadata check alone (same arguments, same ``None`` or
    message), for a caller that must validate before it writes the cache."""
    cdef ap_args a
    cdef int rc
    cdef int64_t bad_req = 0, bad_val = 0
    _set_metadata(&a, block_table, bt_row, query_start_loc, seq_lens, reqs, n_reqs)
    a.block_size = block_size
    a.window = window
    a.causal = causal
    with nogil:
        rc = ap_check(&a, num_tokens, num_qsl, num_seq, bt_rows, bt_cols, num_blocks, &bad_req, &bad_val)
    if rc:
        return _message(rc - 1, bad_req, bad_val, num_tokens, num_qsl, num_seq, bt_rows, bt_cols, num_blocks,
                        block_size)
    return None


def _message(int code, int64_t r, int64_t v, int64_t num_tokens, int64_t num_qsl, int64_t num_seq,
             int64_t bt_rows, int64_t bt_cols, int64_t num_blocks, int block_size):
    return _CHECK_MESSAGES[code].format(r=r, v=v, num_tokens=num_tokens, num_qsl=num_qsl, num_seq=num_seq,
                                        bt_rows=bt_rows, bt_cols=bt_cols, num_blocks=num_blocks,
                                        block_size=block_size)


_CHECK_MESSAGES = (
    "request index {r} is outside query_start_loc ({num_qsl} entries), seq_lens ({num_seq}) or the "
    "block table ({bt_rows} rows)",
    "request {r}: query_start_loc {v} is negative, decreasing or past the {num_tokens} query rows",
    "request {r}: seq_len {v} is negative or shorter than its query",
    "request {r}: seq_len {v} needs more than the block table's {bt_cols} columns of {block_size} tokens",
    "request {r}: block id {v} in a column it reads is outside the KV cache's {num_blocks} blocks",
)
