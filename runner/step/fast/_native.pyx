# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled fast paths of the step compiler (Cython; optional, see ``runner.step.fast``).

The loops that numpy cannot vectorize without many small calls, each a single pass (one
``.pxi`` file per concept, included below):

* :func:`pack_int32` — Python int lists (prompts, block ids) → one ``int32`` buffer,
  type- and range-checked per element (``IntPacker``).
* :class:`CachedScan` (``_native_cached.pxi``) — a step's ``scheduled_cached_reqs`` and
  drafts: row lookup, type and range checks of every field, block-append capacity, in one
  pass (``scan``), written into the checker's plan buffers (``apply_update`` merges them).
* :class:`NewScan` (``_native_admit.pxi``) — a step's ``scheduled_new_reqs``: checked
  and staged in one pass (``scan``), written into their rows (``write_rows``).
* :class:`BlockRows` (``_native_rows.pxi``) — rows cleared and moved in every group, and a
  plan's cached deltas merged (counts, appended blocks with their kernel expansion).
* :class:`Prepare` (``_native_prepare.pxi``) — ``prepare_inputs``' per-token arithmetic:
  ``query_start_loc``, positions, ``input_ids``, ``seq_lens``, ``logits_indices``,
  discard and prefill masks, and every group's slot mapping; with the asynchronous patch
  (``prepare_patched``) in the same pass: its plan and, on a CPU device, the previous
  step's tokens in place of the placeholders, which it does not read.
* :class:`DraftRows` and :class:`SpecLayout` (``_native_spec.pxi``) — speculative decoding's drafts
  written into their rows and laid out for verification.
* :class:`SampledRows` (``_native_stage8.pxi``) — stage 8: ``append_output_tokens``' (one
  token a row), ``append_placeholders``' and ``fill_output_tokens``' checks and writes, a
  pass each.
* :func:`host_int64_vector` (``_native_dlpack.pxi``) — whether the asynchronous patch's
  tensor of sampled tokens can be read in place on the host, and where: its dtype, device,
  shape and strides in one call (DLPack's C exchange API).

The contract that keeps them simple: a fast path either handles its input completely or
reports it *irregular* and changes nothing; the caller then runs the vectorized numpy
path (``runner.step.check``), which accepts every valid input and words the error for
every invalid one. So error messages come from one place, and this module only has to be
right about what it accepts. Every index that comes from the caller's data is checked
against the array it addresses before use (memory safety does not depend on the
caller's validation).
"""

from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBUF_FORMAT, PyBuffer_Release, PyObject_GetBuffer
from cpython.dict cimport PyDict_GetItem, PyDict_Next
from cpython.list cimport PyList_GET_ITEM
from cpython.long cimport PyLong_AsSsize_t
from cpython.object cimport PyObject
from cpython.tuple cimport PyTuple_GET_ITEM
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from libc.stdlib cimport qsort
from libc.string cimport memcpy, memset

import numpy as np

cdef extern from "Python.h":
    bint PyLong_CheckExact(object o)
    bint PyList_CheckExact(object o)
    bint PyTuple_CheckExact(object o)
    bint PyFloat_CheckExact(object o)
    double PyFloat_AS_DOUBLE(object o)

cdef extern from *:
    """
    #if defined(__GNUC__) || defined(__clang__)
    #define attnplug_prefetch(p) __builtin_prefetch((const void *)(p))
    #else
    #define attnplug_prefetch(p) ((void)(p))
    #endif
    """
    void _prefetch "attnplug_prefetch"(const void* p) noexcept

cdef int64_t INT32_MAX = 2147483647
cdef double FLOAT32_MAX = 3.4028234663852886e38
cdef Py_ssize_t PREFETCH = 8  # objects this many requests ahead are prefetched
cdef int64_t PAD_SLOT = -1  # core.constants.PAD_SLOT_ID
cdef int32_t NULL_BLOCK = 0  # core.constants.NULL_BLOCK_ID

NATIVE_API = 9
"""Bumped whenever a signature here changes (``runner.step.fast`` checks it)."""


cdef extern from *:
    """
    #include <stdint.h>
    /* An exact int (not a bool or subclass) that fits int64 -> 1 and *out; else 0.
       Small ints (one digit / "compact") are read inline: ~2.5x faster than the C API. */
    static inline int attnplug_exact_int(PyObject *o, int64_t *out) {
        if (!PyLong_CheckExact(o)) return 0;
    #if PY_VERSION_HEX >= 0x030C0000
        if (PyUnstable_Long_IsCompact((PyLongObject *)o)) {
            *out = (int64_t)PyUnstable_Long_CompactValue((PyLongObject *)o);
            return 1;
        }
    #else
        Py_ssize_t size = Py_SIZE(o);
        if (size == 0) { *out = 0; return 1; }
        if (size == 1) { *out = (int64_t)((PyLongObject *)o)->ob_digit[0]; return 1; }
        if (size == -1) { *out = -(int64_t)((PyLongObject *)o)->ob_digit[0]; return 1; }
    #endif
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow || (v == -1 && PyErr_Occurred())) { PyErr_Clear(); return 0; }
        *out = v;
        return 1;
    }
    """
    bint _exact_int "attnplug_exact_int"(object o, int64_t* out) noexcept


cdef extern from *:
    """
    /* The items of a list or tuple (1, with *items and *n), or 0 for anything else. */
    static inline int attnplug_items(PyObject *s, PyObject ***items, Py_ssize_t *n) {
        if (PyList_CheckExact(s)) { *items = ((PyListObject *)s)->ob_item; *n = PyList_GET_SIZE(s); return 1; }
        if (PyTuple_CheckExact(s)) { *items = ((PyTupleObject *)s)->ob_item; *n = PyTuple_GET_SIZE(s); return 1; }
        return 0;
    }
    /* Ints items[0:n], each in [lo, hi), into out[0:n], widening [*vmin, *vmax] to cover
       them. Prefetches 64 items ahead (the int objects of a step are usually cold: the
       best distance of 8..128 measured on cold prompts). Returns n, or the index of the
       first item that is not an int in range. */
    static inline Py_ssize_t attnplug_pack(PyObject **items, Py_ssize_t n, int32_t *out, int64_t lo,
                                           int64_t hi, int64_t *vmin, int64_t *vmax) {
        for (Py_ssize_t j = 0; j < n; j++) {
            int64_t v;
            if (j + 64 < n) attnplug_prefetch(items[j + 64]);
            if (!attnplug_exact_int(items[j], &v) || v < lo || v >= hi) return j;
            out[j] = (int32_t)v;
            if (v < *vmin) *vmin = v;
            if (v > *vmax) *vmax = v;
        }
        return n;
    }
    """
    bint _items "attnplug_items"(object s, PyObject*** items, Py_ssize_t* n) noexcept
    Py_ssize_t _pack "attnplug_pack"(PyObject** items, Py_ssize_t n, int32_t* out, int64_t lo, int64_t hi,
                                     int64_t* vmin, int64_t* vmax) noexcept


cdef inline bint _real(object x, double* out):
    """``x`` is an exact ``float`` or an ``int64`` ``int`` with a finite value; store it."""
    cdef int64_t v
    if PyFloat_CheckExact(x):
        out[0] = PyFloat_AS_DOUBLE(x)
    elif _exact_int(x, &v):
        out[0] = <double>v
    else:
        return False
    return out[0] - out[0] == 0  # false for inf and nan


cdef Py_ssize_t _token_len(object s):
    """Length of a list, tuple, or 1-D ``int32`` / ``int64`` numpy array; -1 for anything else."""
    cdef PyObject** items
    cdef Py_ssize_t n
    if _items(s, &items, &n):
        return n
    if type(s) is np.ndarray and s.ndim == 1 and (s.dtype == np.int32 or s.dtype == np.int64):
        return s.shape[0]
    return -1


cdef bint _pack_tokens(object s, Py_ssize_t n, int32_t* out):
    """Token ids ``s`` (as :func:`_token_len` accepts, of length ``n``) into ``out``, each
    checked to lie in ``[0, 2**31)``. Holds the array's buffer (or takes the list's items)
    only while reading it."""
    cdef PyObject** items
    cdef Py_ssize_t m, j
    cdef int64_t lo = INT32_MAX, hi = 0
    cdef const int32_t[::1] a32
    cdef const int64_t[::1] a64
    if _items(s, &items, &m):
        return m == n and _pack(items, n, out, 0, INT32_MAX + 1, &lo, &hi) == n
    if type(s) is not np.ndarray:
        return False
    try:
        if s.dtype == np.int32:
            a32 = s
            if a32.shape[0] != n:
                return False
            for j in range(n):
                if a32[j] < 0:
                    return False
                out[j] = a32[j]
            return True
        a64 = s
    except (ValueError, TypeError, BufferError):  # not contiguous, or another dtype
        return False
    if a64.shape[0] != n:
        return False
    for j in range(n):
        if a64[j] < 0 or a64[j] > INT32_MAX:
            return False
        out[j] = <int32_t>a64[j]
    return True


cdef inline Py_ssize_t _seq_len(object s):
    """Length of a list or tuple; -1 for anything else (numpy arrays take the numpy path)."""
    cdef PyObject** items
    cdef Py_ssize_t n
    return n if _items(s, &items, &n) else -1


cdef inline object _item(object s, Py_ssize_t i):
    if PyList_CheckExact(s):
        return <object>PyList_GET_ITEM(s, i)
    return <object>PyTuple_GET_ITEM(s, i)


cdef inline bint _copy_in_range(const int32_t* src, Py_ssize_t n, int32_t* dst, int64_t lo, int64_t hi) noexcept:
    """Copy ``n`` ids; whether every one lies in ``[lo, hi)``."""
    cdef Py_ssize_t t
    cdef bint ok = True
    cdef int32_t x
    for t in range(n):
        x = src[t]
        dst[t] = x
        if x < lo or x >= hi:
            ok = False
    return ok


cdef int _cmp_i32(const void* a, const void* b) noexcept nogil:
    cdef int32_t x = (<const int32_t*>a)[0], y = (<const int32_t*>b)[0]
    return (x > y) - (x < y)


cdef bint _distinct(const int32_t* ids, Py_ssize_t n, int32_t* scratch) noexcept:
    """The ``n`` ids are pairwise distinct. One pass when they ascend (the block pool's
    usual order); else a sort of a copy in ``scratch`` (room for ``n``)."""
    cdef Py_ssize_t t
    for t in range(1, n):
        if ids[t] <= ids[t - 1]:
            break
    else:
        return True
    memcpy(scratch, ids, n * sizeof(int32_t))
    qsort(scratch, n, sizeof(int32_t), _cmp_i32)
    for t in range(1, n):
        if scratch[t] == scratch[t - 1]:
            return False
    return True


cdef extern from *:
    """
    /* Whether b is among row[0:n]: a branch-free OR over chunks of 32 (the compiler
       vectorizes it; an early-exit loop it does not), then the tail. */
    static inline int attnplug_row_has(const int32_t *row, Py_ssize_t n, int32_t b) {
        Py_ssize_t u = 0;
        for (; u + 32 <= n; u += 32) {
            int hit = 0;
            for (int t = 0; t < 32; t++) hit |= row[u + t] == b;
            if (hit) return 1;
        }
        for (; u < n; u++) if (row[u] == b) return 1;
        return 0;
    }
    """
    bint _row_has "attnplug_row_has"(const int32_t* row, Py_ssize_t n, int32_t b) noexcept


cdef bint _distinct_append(const int32_t* row, Py_ssize_t held, const int32_t* new, Py_ssize_t L) noexcept:
    """The ``L`` appended ids ``new`` (never null) repeat neither each other nor one of the
    row's ``held`` ids ``row[0:held]``: ``O(L * (held + L))`` compares (a decode appends
    one block), vectorized over the row."""
    cdef Py_ssize_t t, u
    cdef int32_t b
    for t in range(L):
        b = new[t]
        for u in range(t):
            if new[u] == b:
                return False
        if _row_has(row, held, b):
            return False
    return True


def pack_int32(list seqs, int32_t[::1] out, int64_t lo=0, int64_t hi=INT32_MAX + 1):
    """Pack lists/tuples of ints back to back into ``out``.

    Args:
        seqs: the sequences (lists or tuples of ``int``).
        out: ``int32`` buffer with room for all of them.
        lo, hi: every value must lie in ``[lo, hi)`` (default ``[0, 2**31)``).

    Returns:
        ``(count, min, max)``: the number of ints written and their extremes (``0, 0``
        when none); or ``(-(i + 1), 0, 0)`` when sequence ``i`` is not a list or tuple,
        holds something that is not an ``int``, or a value out of range (what was written
        before it is garbage), ``(-(len(seqs) + 1), 0, 0)`` when ``out`` is too small.
    """
    cdef Py_ssize_t k, n, off = 0, cap = out.shape[0]
    cdef int64_t vmin = hi, vmax = lo
    cdef PyObject** items
    for k in range(len(seqs)):
        if not _items(<object>PyList_GET_ITEM(seqs, k), &items, &n):
            return -(k + 1), 0, 0
        if off + n > cap:
            return -(len(seqs) + 1), 0, 0
        if n and _pack(items, n, &out[off], lo, hi, &vmin, &vmax) != n:
            return -(k + 1), 0, 0
        off += n
    if off == 0:
        vmin = vmax = 0
    return off, vmin, vmax


class PlaceholderRead(Exception):
    """``Prepare``: ``args[0]``, the index of a token read from the token table that is a
    placeholder (a sampled token neither patched nor filled: ``runner/step/placeholders.py``)."""


include "_native_cached.pxi"
include "_native_admit.pxi"
include "_native_rows.pxi"
include "_native_prepare.pxi"
include "_native_prepare_rows.pxi"
include "_native_spec.pxi"
include "_native_dlpack.pxi"
include "_native_stage8.pxi"
