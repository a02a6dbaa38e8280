# CachedScan: scheduled_cached_reqs in one pass — included by _native.pyx (shares its cimports and helpers)

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
        null_ok: per group, whether the row may hold ``NULL_BLOCK_ID`` (a sliding-window
            group's skipped prefix); scheduled positions must not fall in one.
        append_capacity: appended block ids per group one step may carry (more: irregular).
    """

    cdef int32_t[::1] num_tokens, nulled, ncc, sched
    cdef int32_t[:, ::1] nblocks
    cdef list tables, ktables
    cdef int64_t[::1] kpb, capacity, pool, maxb
    cdef list null_ok
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
                 null_ok, Py_ssize_t append_capacity=4096):
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
        self.null_ok = [bool(x) for x in null_ok]
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
        deltas; ``resumed_from_preemption`` exactly ``False``; block appends (lists of
        ints in the group's pool, none already in the row nor twice) that fit the row and,
        with its blocks, cover ``seq_len``.

        Returns:
            ``True`` when the whole input is regular (then ``rows``, ``ncts``, ``counts``
            and the ``app_*`` arrays hold the plan and ``total_tokens`` the count sum);
            ``False`` otherwise (take the numpy path).
        """
        cdef Py_ssize_t n = len(req_ids), i, g, j, m = 0, L, nb, r
        cdef int64_t v, c, seq, total = 0, lo = 0, hi = 0
        cdef PyObject** bitems
        cdef PyObject* p
        cdef PyObject* key
        cdef Py_ssize_t pos = 0
        cdef bint in_order = True
        cdef object rid, e
        cdef int32_t[:, ::1] tab
        cdef int64_t B
        cdef int G = self.G
        if (len(num_computed_tokens) != n or len(new_token_ids) != n or len(new_block_ids) != n
                or len(resumed_from_preemption) != n or n > self.max_num_reqs
                or type(num_scheduled_tokens) is not dict or type(req_id_to_index) is not dict):
            return False  # (a dict subclass may override lookups, which PyDict_* bypass)
        self.gen += 1
        for g in range(G):
            self._ntot[g] = 0
        for i in range(n):
            if i + PREFETCH < n:  # the step's objects are cold: start their loads early
                _prefetch(PyList_GET_ITEM(req_ids, i + PREFETCH))
                _prefetch(PyList_GET_ITEM(num_computed_tokens, i + PREFETCH))
                _prefetch(PyList_GET_ITEM(new_token_ids, i + PREFETCH))
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
            # num_scheduled_tokens usually lists the cached requests first, in this order:
            # walk it alongside (no hashing); look the id up once the orders part
            p = NULL
            if in_order and PyDict_Next(num_scheduled_tokens, &pos, &key, &p) and key == <PyObject*>rid:
                pass
            else:
                in_order = False
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
                    if not _items(_item(e, g), &bitems, &L):
                        return False
                    nb = self.nblocks[g, r] + L
                    if nb > self.maxb[g] or nb * self.capacity[g] < seq:
                        return False
                    if self._ntot[g] + L > self._ids.shape[1]:
                        return False
                    if L and _pack(bitems, L, &self._ids[g, self._ntot[g]], 1, self.pool[g], &lo, &hi) != L:
                        return False
                    if L and not _distinct_append(self.tables[g], r, self.nblocks[g, r],
                                                  &self._ids[g, self._ntot[g]], L):
                        return False  # a block id twice in the row: the numpy path words it
                    self._start[g, m] = self.nblocks[g, r]
                    self._len[g, m] = L
                    self._ntot[g] += L
                self._sel[m] = i
                m += 1
            self._rows[i] = r
            self._ncts[i] = v
            self._counts[i] = c
        for g in range(G):  # no scheduled position in a null block the row already holds
            if not self.null_ok[g]:
                continue
            tab = self.tables[g]
            B = self.capacity[g]
            for i in range(n):
                r = self._rows[i]
                v = self._ncts[i]
                seq = min((v + self._counts[i] - 1) // B, <int64_t>self.nblocks[g, r] - 1)
                for j in range(v // B, seq + 1):
                    if tab[r, j] == NULL_BLOCK:
                        return False
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
