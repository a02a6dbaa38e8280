# cython: language_level=3, boundscheck=False, wraparound=False
"""The paged K/V write of ``cpu_sdpa`` (vLLM's ``reshape_and_cache`` semantics), in C.

One row per write: ``num_kv_heads * head_size`` contiguous elements of the step's key (and
value) row ``token_indices[i]`` copied to flat slot ``slots[i]`` of the cache
``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (K at ``[slot // block_size, 0,
slot % block_size]``, V at ``[..., 1, ...]``). Every index is checked before the first byte
is written. The Python-facing wrapper is ``kv_write.py`` (layouts, dtypes); this module
takes raw addresses, byte strides and sizes.
"""

from libc.stdint cimport int64_t, uintptr_t
from libc.string cimport memcpy


def write_rows(uintptr_t key, int64_t key_row_stride, uintptr_t value, int64_t value_row_stride,
               uintptr_t cache, int64_t block_size, int64_t num_blocks, int64_t row_bytes,
               uintptr_t slots, uintptr_t token_indices, int64_t num_writes, int64_t num_tokens):
    """Copy ``num_writes`` K and V rows of ``row_bytes`` bytes each into the cache.

    ``key_row_stride`` / ``value_row_stride``: bytes between token rows of key / value;
    ``slots`` / ``token_indices``: ``int64[num_writes]``. Returns ``-1`` after writing, or
    the first ``i`` whose slot is outside ``[0, num_blocks * block_size)`` or whose token
    index is outside ``[0, num_tokens)``, having written nothing."""
    cdef const int64_t *s = <const int64_t *> slots
    cdef const int64_t *t = <const int64_t *> token_indices
    cdef char *c = <char *> cache
    cdef const char *k = <const char *> key
    cdef const char *v = <const char *> value
    cdef int64_t i, slot, block, num_slots = num_blocks * block_size
    cdef int64_t plane = block_size * row_bytes
    with nogil:
        for i in range(num_writes):
            if s[i] < 0 or s[i] >= num_slots or t[i] < 0 or t[i] >= num_tokens:
                with gil:
                    return i
        for i in range(num_writes):
            slot = s[i]
            block = slot // block_size
            memcpy(c + block * 2 * plane + (slot - block * block_size) * row_bytes, k + t[i] * key_row_stride,
                   row_bytes)
            memcpy(c + (block * 2 + 1) * plane + (slot - block * block_size) * row_bytes,
                   v + t[i] * value_row_stride, row_bytes)
    return -1
