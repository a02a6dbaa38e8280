# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled fast paths of the step compiler (Cython; optional, see ``runner.native``).

Three loops that numpy cannot vectorize without many small calls, each a single pass:

* :func:`pack_int32` — Python int lists (prompts, block ids) → one ``int32`` buffer,
  type- and range-checked per element.
* :class:`CachedScan` — the ``scheduled_cached_reqs`` of a step: row lookup, type and
  range checks of every field, block-append capacity, all in one pass (``scan``); then,
  after the rest of the output was validated, the merge into the batch (``apply``).
* :class:`Prepare` — ``prepare_inputs``' per-token arithmetic: ``query_start_loc``,
  positions, ``input_ids``, ``seq_lens``, ``logits_indices``, discard and prefill masks,
  and every group's slot mapping.

The contract that keeps them simple: a fast path either handles its input completely or
reports it *irregular* and changes nothing; the caller then runs the vectorized numpy
path (``runner.update_states``), which accepts every valid input and words the error for
every invalid one. So error messages come from one place, and this module only has to be
right about what it accepts. Every index that comes from the caller's data is checked
against the array it addresses before use (memory safety does not depend on the
caller's validation).
"""

from cpython.dict cimport PyDict_GetItem
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.long cimport PyLong_AsSsize_t
from cpython.object cimport PyObject
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from libc.stdint cimport int32_t, int64_t, uint8_t

import numpy as np

cdef extern from "Python.h":
    bint PyLong_CheckExact(object o)
    bint PyList_CheckExact(object o)
    bint PyTuple_CheckExact(object o)

cdef int64_t INT32_MAX = 2147483647
cdef int64_t PAD_SLOT = -1  # core.constants.PAD_SLOT_ID
cdef int32_t NULL_BLOCK = 0  # core.constants.NULL_BLOCK_ID

NATIVE_API = 1
"""Bumped whenever a signature here changes (``runner.native`` checks it)."""


cdef extern from *:
    """
    /* An exact int (not a bool or subclass) that fits int64 -> 1 and *out; else 0.
       Small ints (one digit / "compact") are read inline: ~2.5x faster than the C API. */
    static inline int attnplug_exact_int(PyObject *o, long long *out) {
        if (!PyLong_CheckExact(o)) return 0;
    #if PY_VERSION_HEX >= 0x030C0000
        if (PyUnstable_Long_IsCompact((PyLongObject *)o)) {
            *out = (long long)PyUnstable_Long_CompactValue((PyLongObject *)o);
            return 1;
        }
    #else
        Py_ssize_t size = Py_SIZE(o);
        if (size == 0) { *out = 0; return 1; }
        if (size == 1) { *out = (long long)((PyLongObject *)o)->ob_digit[0]; return 1; }
        if (size == -1) { *out = -(long long)((PyLongObject *)o)->ob_digit[0]; return 1; }
    #endif
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow || (v == -1 && PyErr_Occurred())) { PyErr_Clear(); return 0; }
        *out = v;
        return 1;
    }
    """
    bint _exact_int "attnplug_exact_int"(object o, int64_t* out) noexcept


cdef inline Py_ssize_t _seq_len(object s):
    """Length of a list or tuple; -1 for anything else (numpy arrays take the numpy path)."""
    if PyList_CheckExact(s):
        return PyList_GET_SIZE(s)
    if PyTuple_CheckExact(s):
        return PyTuple_GET_SIZE(s)
    return -1


cdef inline object _item(object s, Py_ssize_t i):
    if PyList_CheckExact(s):
        return <object>PyList_GET_ITEM(s, i)
    return <object>PyTuple_GET_ITEM(s, i)


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
    cdef Py_ssize_t k, i, n, off = 0, cap = out.shape[0]
    cdef int64_t v, vmin = hi, vmax = lo
    cdef object s, o
    for k in range(len(seqs)):
        s = <object>PyList_GET_ITEM(seqs, k)
        n = _seq_len(s)
        if n < 0:
            return -(k + 1), 0, 0
        if off + n > cap:
            return -(len(seqs) + 1), 0, 0
        for i in range(n):
            o = _item(s, i)
            if not _exact_int(o, &v) or v < lo or v >= hi:
                return -(k + 1), 0, 0
            out[off + i] = <int32_t>v
            if v < vmin:
                vmin = v
            if v > vmax:
                vmax = v
        off += n
    if off == 0:
        vmin = vmax = 0
    return off, vmin, vmax


cdef class CachedScan:
    """Validate-then-merge of ``scheduled_cached_reqs`` for one ``InputBatch``.

    Bound once to the batch's persistent columns. ``scan`` reads only; ``apply`` writes
    what the last successful ``scan`` planned.

    Args:
        num_tokens, nulled, num_computed_tokens, num_scheduled_tokens: the batch's
            ``[max_num_reqs]`` ``int32`` columns.
        num_blocks_per_row: ``[G, max_num_reqs]`` ``int32``.
        block_tables: per group, the ``[max_num_reqs, max_blocks_g]`` ``int32`` manager table.
        kernel_tables: per group, the kernel table (the same array when ``k == 1``).
        kernel_blocks_per_block: per group, ``k``.
        capacity: per group, tokens one block covers (``max_model_len`` for Mamba).
        pool: per group, the exclusive upper bound of block ids.
        append_capacity: appended block ids per group one step may carry (more: irregular).
    """

    cdef int32_t[::1] num_tokens, nulled, ncc, sched
    cdef int32_t[:, ::1] nblocks
    cdef list tables, ktables
    cdef int64_t[::1] kpb, capacity, pool, maxb
    cdef int64_t[::1] stamp
    cdef int64_t gen
    cdef readonly int G, max_num_reqs
    cdef readonly object rows, ncts, counts, app_sel, app_start, app_len, app_ids
    cdef int64_t[::1] _rows, _ncts, _counts, _sel
    cdef int64_t[:, ::1] _start, _len
    cdef int32_t[:, ::1] _ids
    cdef readonly Py_ssize_t num_cached, num_appends, total_tokens
    cdef Py_ssize_t[::1] _ntot

    def __init__(self, num_tokens, nulled, num_computed_tokens, num_scheduled_tokens, num_blocks_per_row,
                 list block_tables, list kernel_tables, kernel_blocks_per_block, capacity, pool,
                 Py_ssize_t append_capacity=4096):
        self.num_tokens, self.nulled = num_tokens, nulled
        self.ncc, self.sched = num_computed_tokens, num_scheduled_tokens
        self.nblocks = num_blocks_per_row
        self.G = self.nblocks.shape[0]
        self.max_num_reqs = self.nblocks.shape[1]
        self.tables, self.ktables = block_tables, kernel_tables
        self.kpb = np.asarray(kernel_blocks_per_block, dtype=np.int64)
        self.capacity = np.asarray(capacity, dtype=np.int64)
        self.pool = np.asarray(pool, dtype=np.int64)
        self.maxb = np.asarray([t.shape[1] for t in block_tables], dtype=np.int64)
        self.stamp = np.zeros(self.max_num_reqs, dtype=np.int64)
        self.gen = 0
        M = self.max_num_reqs
        self.rows, self.ncts, self.counts = (np.zeros(M, np.int64) for _ in range(3))
        self._rows, self._ncts, self._counts = self.rows, self.ncts, self.counts
        self.app_sel = np.zeros(M, np.int64)
        self._sel = self.app_sel
        self.app_start = np.zeros((self.G, M), np.int64)
        self.app_len = np.zeros((self.G, M), np.int64)
        self._start, self._len = self.app_start, self.app_len
        self.app_ids = np.zeros((self.G, append_capacity), np.int32)
        self._ids = self.app_ids
        self._ntot = np.zeros(self.G, np.intp)

    def scan(self, list req_ids, dict req_id_to_index, list num_computed_tokens, dict num_scheduled_tokens,
             list new_token_ids, list new_block_ids, list resumed_from_preemption, finished):
        """Check the cached requests and plan their merge; change nothing in the batch.

        Regular means: every id is in the batch once and not finished; every
        ``num_computed_tokens`` an ``int >= 0`` at or past the row's nulled prefix; every
        count an ``int >= 1`` with ``num_computed_tokens + count <= num_tokens``; no token
        deltas; ``resumed_from_preemption`` exactly ``False``; block appends (lists of ints in the group's pool) that
        fit the row and, with its blocks, cover ``seq_len``.

        Returns:
            ``True`` when the whole input is regular (then ``rows``, ``ncts``, ``counts``
            and the ``app_*`` arrays hold the plan and ``total_tokens`` the count sum);
            ``False`` otherwise (take the numpy path).
        """
        cdef Py_ssize_t n = len(req_ids), i, g, j, m = 0, L, nb, r
        cdef int64_t v, c, seq, total = 0, bid
        cdef PyObject* p
        cdef object rid, e, lst
        cdef int G = self.G
        if (len(num_computed_tokens) != n or len(new_token_ids) != n or len(new_block_ids) != n
                or len(resumed_from_preemption) != n or n > self.max_num_reqs):
            return False
        self.gen += 1
        for g in range(G):
            self._ntot[g] = 0
        for i in range(n):
            rid = <object>PyList_GET_ITEM(req_ids, i)
            if type(rid) is not str:
                return False
            p = PyDict_GetItem(req_id_to_index, rid)
            if p is NULL:
                return False
            r = PyLong_AsSsize_t(<object>p)
            if r < 0 or r >= self.max_num_reqs or self.stamp[r] == self.gen:
                return False
            self.stamp[r] = self.gen
            if not _exact_int(<object>PyList_GET_ITEM(num_computed_tokens, i), &v) or v < 0 \
                    or v < self.nulled[r]:
                return False
            p = PyDict_GetItem(num_scheduled_tokens, rid)
            if p is NULL or not _exact_int(<object>p, &c) or c < 1:
                return False
            seq = v + c
            if seq > self.num_tokens[r]:
                return False
            total += c
            if <object>PyList_GET_ITEM(resumed_from_preemption, i) is not False:
                return False  # resumed (or not a bool): replaces blocks, the numpy path does it
            if _seq_len(<object>PyList_GET_ITEM(new_token_ids, i)) != 0:
                return False
            e = <object>PyList_GET_ITEM(new_block_ids, i)
            if e is None:
                for g in range(G):
                    if <int64_t>self.nblocks[g, r] * self.capacity[g] < seq:
                        return False
            else:
                if _seq_len(e) != G:
                    return False
                for g in range(G):
                    lst = _item(e, g)
                    L = _seq_len(lst)
                    if L < 0:
                        return False
                    nb = self.nblocks[g, r] + L
                    if nb > self.maxb[g] or nb * self.capacity[g] < seq:
                        return False
                    if self._ntot[g] + L > self._ids.shape[1]:
                        return False
                    for j in range(L):
                        if not _exact_int(_item(lst, j), &bid) or bid < 1 or bid >= self.pool[g]:
                            return False
                        self._ids[g, self._ntot[g] + j] = <int32_t>bid
                    self._start[g, m] = self.nblocks[g, r]
                    self._len[g, m] = L
                    self._ntot[g] += L
                self._sel[m] = i
                m += 1
            self._rows[i] = r
            self._ncts[i] = v
            self._counts[i] = c
        for rid in finished:
            p = PyDict_GetItem(req_id_to_index, rid)
            if p is not NULL:
                r = PyLong_AsSsize_t(<object>p)
                if 0 <= r < self.max_num_reqs and self.stamp[r] == self.gen:
                    return False
        self.num_cached, self.num_appends, self.total_tokens = n, m, total
        return True

    def is_scheduled(self, Py_ssize_t row):
        """Whether the last ``scan`` saw a request at ``row``."""
        return 0 <= row < self.max_num_reqs and self.stamp[row] == self.gen

    def apply(self):
        """Merge the last successful scan into the batch: counts, then block appends
        (manager ids and their kernel expansion ``b*k .. b*k+k-1``)."""
        cdef Py_ssize_t i, j, g, t, off, r, col, q
        cdef int64_t k, b
        cdef int32_t[:, ::1] tab, ktab
        for i in range(self.num_cached):
            r = self._rows[i]
            self.ncc[r] = <int32_t>self._ncts[i]
            self.sched[r] = <int32_t>self._counts[i]
        if self.num_appends == 0:
            return
        for g in range(self.G):
            tab = self.tables[g]
            ktab = self.ktables[g]
            k = self.kpb[g]
            off = 0
            for j in range(self.num_appends):
                r = self._rows[self._sel[j]]
                col = self._start[g, j]
                for t in range(self._len[g, j]):
                    b = self._ids[g, off + t]
                    tab[r, col + t] = <int32_t>b
                    if k > 1:
                        for q in range(k):
                            ktab[r, (col + t) * k + q] = <int32_t>(b * k + q)
                off += self._len[g, j]
                self.nblocks[g, r] = <int32_t>(col + self._len[g, j])


cdef class BlockRows:
    """Row operations on every group of a ``MultiGroupBlockTable``, bound to its arrays.

    Args:
        num_blocks_per_row: ``[G, max_num_reqs]`` ``int32``.
        block_tables, kernel_tables: per group, the manager and kernel tables (the same
            array when ``k == 1``).
        kernel_blocks_per_block: per group, ``k``.
    """

    cdef int32_t[:, ::1] nblocks
    cdef list tables, ktables
    cdef int64_t[::1] kpb

    def __init__(self, num_blocks_per_row, list block_tables, list kernel_tables, kernel_blocks_per_block):
        self.nblocks = num_blocks_per_row
        self.tables, self.ktables = block_tables, kernel_tables
        self.kpb = np.asarray(kernel_blocks_per_block, dtype=np.int64)

    def clear_rows(self, list rows):
        """Set the blocks of ``rows`` (Python ints) to ``NULL_BLOCK_ID`` in every group and
        their counts to 0.

        Raises:
            IndexError: a row outside the table (nothing after it is cleared).
        """
        cdef Py_ssize_t g, i, r, n, M = self.nblocks.shape[1], t
        cdef int64_t k
        cdef int32_t[:, ::1] tab, ktab
        for i in range(len(rows)):
            r = rows[i]
            if r < 0 or r >= M:
                raise IndexError(f"row {r} is outside the block table ({M} rows)")
        for g in range(self.nblocks.shape[0]):
            tab = self.tables[g]
            ktab = self.ktables[g]
            k = self.kpb[g]
            for i in range(len(rows)):
                r = rows[i]
                n = self.nblocks[g, r]
                for t in range(n):
                    tab[r, t] = NULL_BLOCK
                if k > 1:
                    for t in range(n * k):
                        ktab[r, t] = NULL_BLOCK
                self.nblocks[g, r] = 0


cdef class Prepare:
    """``prepare_inputs``' per-token arithmetic over rows ``0 .. R-1``, bound to the
    batch's columns and the step's persistent host buffers (see ``InputPreparer``).

    ``slot_tables``: per group, the manager block table, or ``None`` for a group without
    paged K/V (Mamba state: every slot is ``PAD_SLOT_ID``); ``block_sizes``: per group.
    """

    cdef int32_t[::1] sched, ncc, num_tokens, num_prompt
    cdef int32_t[:, ::1] tokens
    cdef int32_t[::1] qsl, input_ids, seq_lens
    cdef int64_t[::1] positions, logits_indices, req_indices
    cdef uint8_t[::1] discard, is_prefilling
    cdef list slot_tables, slot_mappings
    cdef int64_t[::1] block_sizes

    def __init__(self, sched, ncc, num_tokens, num_prompt, tokens, qsl, positions, input_ids, seq_lens,
                 logits_indices, req_indices, discard, is_prefilling, list slot_tables, list slot_mappings,
                 block_sizes):
        self.sched, self.ncc, self.num_tokens, self.num_prompt = sched, ncc, num_tokens, num_prompt
        self.tokens = tokens
        self.qsl, self.positions, self.input_ids, self.seq_lens = qsl, positions, input_ids, seq_lens
        self.logits_indices, self.req_indices = logits_indices, req_indices
        self.discard, self.is_prefilling = discard.view(np.uint8), is_prefilling.view(np.uint8)
        self.slot_tables, self.slot_mappings = slot_tables, slot_mappings
        self.block_sizes = np.asarray(block_sizes, dtype=np.int64)

    def prepare(self, Py_ssize_t R, Py_ssize_t P):
        """Fill the buffers for ``R`` rows, padding the token dimension to ``P`` (``P <
        num_actual_tokens`` means no padding).

        Returns:
            ``(num_actual_tokens, max_query_len, max_seq_len)``.

        Raises:
            IndexError: a row's scheduled positions leave the token table, a token
                buffer would overflow, or a position's block lies outside its row (the
                step compiler's validation excludes all three).
        """
        cdef Py_ssize_t r, t, Q = 0, q, maxq = 0, maxs = 0, g, col, ncols
        cdef int64_t pos, c, B, shift
        cdef Py_ssize_t width = self.tokens.shape[1], cap = self.positions.shape[0]
        cdef int32_t[:, ::1] tab
        cdef int64_t[::1] sm
        # local pointers: the compiler cannot prove the buffers do not alias, so reading
        # them through the memoryview structs would reload every field after every store
        cdef int32_t* sched = &self.sched[0]
        cdef int32_t* ncc = &self.ncc[0]
        cdef int32_t* qsl = &self.qsl[0]
        cdef int32_t* ids = &self.input_ids[0]
        cdef int32_t* tok = &self.tokens[0, 0]
        cdef int32_t* tb
        cdef int64_t* positions = &self.positions[0]
        cdef int64_t* req = &self.req_indices[0]
        cdef int64_t* slots
        if R > self.sched.shape[0]:
            raise IndexError(f"{R} rows but the batch holds {self.sched.shape[0]}")
        qsl[0] = 0
        for r in range(R):  # per row: the row's tokens, counts and masks
            q = sched[r]
            c = ncc[r]
            if q < 0 or c < 0 or c + q > width or Q + q > cap:
                raise IndexError(f"row {r}: positions [{c}, {c + q}) leave the token table or buffers")
            for t in range(q):
                req[Q + t] = r
                positions[Q + t] = c + t
            Q += q
            qsl[r + 1] = <int32_t>Q
            self.seq_lens[r] = <int32_t>(c + q)
            self.logits_indices[r] = Q - 1
            self.discard[r] = (c + q) < self.num_tokens[r]
            self.is_prefilling[r] = c < self.num_prompt[r]
            if q > maxq:
                maxq = q
            if c + q > maxs:
                maxs = c + q
        if P > cap:
            raise IndexError(f"padding to {P} tokens but the buffers hold {cap}")
        for t in range(Q):  # the gather, in its own loop: independent loads overlap
            ids[t] = tok[req[t] * width + positions[t]]
        for t in range(Q, P):
            positions[t] = 0
            ids[t] = 0
        for g in range(len(self.slot_tables)):
            sm = self.slot_mappings[g]
            slots = &sm[0]
            if self.slot_tables[g] is None:
                for t in range(max(Q, P)):
                    slots[t] = PAD_SLOT
                continue
            tab = self.slot_tables[g]
            tb = &tab[0, 0]
            ncols = tab.shape[1]
            B = self.block_sizes[g]
            shift = -1  # a power-of-two block size divides with a shift (idiv is ~40 cycles)
            if B & (B - 1) == 0:
                shift = 0
                while (1 << shift) < B:
                    shift += 1
            for t in range(Q):
                pos = positions[t]
                col = (pos >> shift) if shift >= 0 else pos // B
                if col >= ncols:
                    raise IndexError(f"group {g}: position {pos} lies past the block table")
                slots[t] = <int64_t>tb[req[t] * ncols + col] * B + (pos - col * B)
            for t in range(Q, P):
                slots[t] = PAD_SLOT
        return Q, maxq, maxs
