# CachedScan: scheduled_cached_reqs in one pass — included by _native.pyx (shares its cimports and helpers)

cdef class _PackedBuffers:
    """The four arrays of a ``PackedCachedDeltas`` as raw ``int32`` pointers: buffers held
    (plain buffer protocol, no typed memoryview: the arrays are new every step, and a typed
    view's format validation cost ~2-3 µs each) and released when this object goes."""

    cdef Py_buffer views[4]
    cdef int held
    cdef const int32_t* p[4]
    cdef Py_ssize_t length[4]
    cdef Py_ssize_t G, cols

    def __dealloc__(self):
        cdef int k
        for k in range(self.held):
            PyBuffer_Release(&self.views[k])


cdef _PackedBuffers _packed_buffers(tuple packed):
    """``(num_draft_tokens, draft_token_ids, num_new_blocks, new_block_ids)`` held, or
    ``None`` when one is not a C-contiguous ``int32`` buffer of its rank (1, 1, 2, 1)."""
    cdef _PackedBuffers b = _PackedBuffers.__new__(_PackedBuffers)
    cdef int k
    cdef Py_buffer* v
    cdef const char* f
    for k in range(4):
        v = &b.views[k]
        try:
            PyObject_GetBuffer(packed[k], v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)
        except (TypeError, ValueError, BufferError):
            return None
        b.held += 1
        f = v.format
        if v.itemsize != 4 or f == NULL or not (f[0] == c'i' or f[0] == c'l') or f[1] != 0 \
                or v.ndim != (2 if k == 2 else 1):
            return None
        b.p[k] = <const int32_t*>v.buf
        b.length[k] = v.shape[0]
    b.G = b.views[2].shape[0]
    b.cols = b.views[2].shape[1]
    return b


cdef class CachedScan:
    """The compiled check of ``scheduled_cached_reqs`` for one ``InputBatch``: reads only.

    Bound once to the batch's persistent columns (read) and to the plan buffers the
    checker owns (written by ``scan``: ``runner/step/plan.py``'s ``ScanBuffers``).

    Args:
        num_tokens, nulled: the batch's ``[max_num_reqs]`` ``int32`` columns.
        num_blocks_per_row: ``[G, max_num_reqs]`` ``int32``.
        block_id_bound: ``[G, max_num_reqs]`` ``int32``: per row an upper bound of the ids it
            holds (``BlockTable.block_id_bound``): an append whose ids all exceed it cannot
            repeat a held id, and its row is not read.
        block_tables: per group, the ``[max_num_reqs, max_blocks_g]`` ``int32`` manager table.
        capacity: per group, tokens one block covers (``max_model_len`` for Mamba).
        pool: per group, the exclusive upper bound of block ids.
        null_ok: per group, whether the row may hold ``NULL_BLOCK_ID`` (a sliding-window
            group's skipped prefix); scheduled positions must not fall in one.
        max_model_len: tokens a request may hold (a verifying row's ``num_tokens + d`` stays
            below it: its ``1 + d`` emitted tokens must fit).
        rows, ncts, counts: ``[max_num_reqs]`` ``int64`` plan buffers: per cached request
            (in ``req_ids`` order) its row, ``num_computed_tokens``, ``num_scheduled_tokens``.
        app_sel: ``[max_num_reqs]`` ``int64``: the cached indices that append blocks.
        app_start, app_len: ``[G, max_num_reqs]`` ``int64``: per appending request, blocks
            held before the append and blocks appended.
        app_ids: ``[G, A]`` ``int32``: per group the appended ids, in ``app_sel`` order
            (more than ``A`` in one group: irregular).
        app_total: ``[G]`` ``int64``: appended ids per group.
        app_after: ``[G, max_num_reqs]`` ``int64``: per appending request, blocks held after.
        app_flat: ``[G * A]`` ``int32``: every group's appended ids back to back (group-major).
        spec_sel, spec_rows, spec_lens: ``[max_num_reqs]`` ``int64``: per verifying request
            (in ``req_ids`` order) its cached index, its row and its draft count.
        spec_ids: ``[S]`` ``int32``: the drafts, in ``req_ids`` order (more: irregular).
    """

    cdef int32_t[::1] num_tokens, nulled
    cdef int32_t[:, ::1] nblocks, idbound
    cdef list tables
    cdef int64_t[::1] capacity, pool, maxb
    cdef list null_ok
    cdef int64_t[::1] stamp
    cdef int64_t gen, max_model_len
    cdef readonly int G, max_num_reqs
    cdef int64_t[::1] _rows, _ncts, _counts, _sel, _ntot, _spec_sel, _spec_rows, _spec_lens
    cdef int64_t[:, ::1] _start, _len, _after
    cdef int32_t[:, ::1] _ids
    cdef int32_t[::1] _flat
    cdef int32_t[::1] _spec_ids
    cdef int64_t[::1] _tab_addr, _tab_width
    cdef int64_t[::1] _pk_off
    cdef readonly Py_ssize_t num_cached, num_appends, total_tokens, num_spec, spec_total, num_appended
    cdef readonly bint one_each

    def __init__(self, num_tokens, nulled, num_blocks_per_row, block_id_bound, list block_tables, capacity, pool, null_ok,
                 int64_t max_model_len, rows, ncts, counts, app_sel, app_start, app_len, app_ids, app_total,
                 app_after, app_flat, spec_sel, spec_rows, spec_lens, spec_ids):
        self.num_tokens, self.nulled = num_tokens, nulled
        self.nblocks = num_blocks_per_row
        self.idbound = block_id_bound
        self.G = self.nblocks.shape[0]
        self.max_num_reqs = self.nblocks.shape[1]
        if self.idbound.shape[0] != self.G or self.idbound.shape[1] != self.max_num_reqs:
            raise ValueError("CachedScan: block_id_bound must have num_blocks_per_row's shape")
        self.tables = block_tables  # (keeps the arrays alive: _tab_addr points into them)
        for t in block_tables:
            if t.dtype != np.int32 or not t.flags.c_contiguous or t.shape[0] != self.max_num_reqs:
                raise ValueError("CachedScan: block tables must be C-contiguous int32 [max_num_reqs, w]")
        self._tab_addr = np.asarray([t.ctypes.data for t in block_tables], dtype=np.int64)
        self._tab_width = np.asarray([t.shape[1] for t in block_tables], dtype=np.int64)
        self.capacity = np.asarray(capacity, dtype=np.int64)
        self.pool = np.asarray(pool, dtype=np.int64)
        self.maxb = np.asarray([t.shape[1] for t in block_tables], dtype=np.int64)
        self.null_ok = [bool(x) for x in null_ok]
        self.max_model_len = max_model_len
        self.stamp = np.zeros(self.max_num_reqs, dtype=np.int64)
        self._pk_off = np.zeros(self.G, dtype=np.int64)
        self.gen = 0
        self._rows, self._ncts, self._counts = rows, ncts, counts
        self._sel, self._start, self._len, self._ids, self._ntot = app_sel, app_start, app_len, app_ids, app_total
        self._after, self._flat = app_after, app_flat
        self._spec_sel, self._spec_rows, self._spec_lens, self._spec_ids = spec_sel, spec_rows, spec_lens, spec_ids
        if (self._rows.shape[0] < self.max_num_reqs or self._ncts.shape[0] < self.max_num_reqs
                or self._counts.shape[0] < self.max_num_reqs or self._sel.shape[0] < self.max_num_reqs
                or self._spec_lens.shape[0] < self.max_num_reqs or self._spec_sel.shape[0] < self.max_num_reqs
                or self._spec_rows.shape[0] < self.max_num_reqs or self._after.shape[0] != self.G
                or self._after.shape[1] < self.max_num_reqs or self._flat.shape[0] < self.G * self._ids.shape[1]
                or self._start.shape[0] != self.G
                or self._len.shape[0] != self.G or self._ids.shape[0] != self.G or self._ntot.shape[0] != self.G
                or self._start.shape[1] < self.max_num_reqs or self._len.shape[1] < self.max_num_reqs):
            raise ValueError("CachedScan: a plan buffer is smaller than the batch")

    def scan(self, list req_ids, dict req_id_to_index, list num_computed_tokens, dict num_scheduled_tokens,
             list new_token_ids, list new_block_ids, list resumed_from_preemption, finished, dict spec,
             packed=None):
        """Check the cached requests and plan their merge; change nothing in the batch.

        Regular means: every id is in the batch once and not finished; every
        ``num_computed_tokens`` an ``int >= 0`` at or past the row's nulled prefix; every
        count an ``int >= 1`` with ``num_computed_tokens + count <= num_tokens``; no token
        deltas; drafts (``spec``, ``scheduled_spec_decode_tokens``) only for cached
        requests, each a non-empty list of ints in ``[0, 2**31)`` for a decoding row (one
        real token left) scheduled ``1 + d`` tokens whose ``1 + d`` emitted tokens fit ``max_model_len``; ``resumed_from_preemption`` exactly ``False``; block appends (lists of
        ints in the group's pool, none already in the row nor twice) that fit the row and,
        with its blocks, cover ``seq_len``.

        ``packed`` (``None``, or a ``PackedCachedDeltas``'s four arrays as a tuple:
        ``runner/step/scheduler_output.py``) carries the drafts and appends as ``int32``
        arrays aligned with ``req_ids``; they are read as arrays (no Python object per
        draft or append). Then ``spec`` must be empty and ``new_block_ids`` all ``None``
        (else irregular), and the counts must match the arrays.

        Returns:
            ``True`` when the whole input is regular (then the plan buffers hold the plan,
            ``total_tokens`` the count sum, ``num_appends`` the appending requests,
            ``num_spec`` / ``spec_total`` the verifying requests and their drafts);
            ``False`` otherwise (take the numpy path).
        """
        cdef Py_ssize_t n = len(req_ids), i, g, j, m = 0, L, nb, r, nd, ns = 0, stot = 0
        cdef int64_t v, c, seq, held, total = 0, lo = 0, hi = 0
        cdef bint has_spec = len(spec) > 0
        cdef PyObject* d
        cdef PyObject** bitems
        cdef PyObject* p
        cdef PyObject* key
        cdef Py_ssize_t pos = 0
        cdef bint in_order = True
        cdef PyObject* spec_key = NULL
        cdef PyObject* spec_next = NULL
        cdef Py_ssize_t spec_pos = 0
        cdef bint spec_in_order = has_spec and PyDict_Next(spec, &spec_pos, &spec_key, &spec_next)
        cdef PyObject* ahead_key = NULL
        cdef PyObject* ahead_val = NULL
        cdef Py_ssize_t ahead_pos = spec_pos  # a second cursor, PREFETCH entries ahead
        for j in range(PREFETCH if spec_in_order else 0):
            if not PyDict_Next(spec, &ahead_pos, &ahead_key, &ahead_val):
                break
            _prefetch(ahead_val)
        cdef object rid, e
        cdef int32_t[:, ::1] tab
        cdef int64_t B
        cdef int G = self.G
        cdef bint pk = packed is not None
        cdef _PackedBuffers pb = None
        cdef const int32_t* pk_nd = NULL
        cdef const int32_t* pk_dids = NULL
        cdef const int32_t* pk_nb = NULL
        cdef const int32_t* pk_bids = NULL
        cdef Py_ssize_t n_dids = 0
        # local pointers: through the memoryview structs every store would reload them
        cdef int64_t* spec_sel = &self._spec_sel[0]
        cdef int64_t* spec_rows = &self._spec_rows[0]
        cdef int64_t* spec_lens = &self._spec_lens[0]
        if pk:  # (num_draft_tokens, draft_token_ids, num_new_blocks, new_block_ids)
            if has_spec or type(packed) is not tuple or len(<tuple>packed) != 4:
                return False
            pb = _packed_buffers(<tuple>packed)
            if pb is None or pb.length[0] != n or pb.G != G or pb.cols != n or not self._packed_offsets(n, pb):
                return False
            pk_nd, pk_dids, pk_nb, pk_bids = pb.p[0], pb.p[1], pb.p[2], pb.p[3]
            n_dids = pb.length[1]
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
                _prefetch(PyList_GET_ITEM(new_block_ids, i + PREFETCH))
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
            held = self.num_tokens[r]
            if pk:
                nd = pk_nd[i]
                if nd:  # drafts: a decoding row verifying nd >= 1 of them (their ids are
                    # copied and range-checked in one pass after the loop: in request order,
                    # the verifying rows' drafts are the array's first stot ids)
                    if nd < 0 or held - v != 1 or c != 1 + nd or held + nd >= self.max_model_len \
                            or stot + nd > self._spec_ids.shape[0] or stot + nd > n_dids:
                        return False
                    spec_sel[ns] = i
                    spec_rows[ns] = r
                    spec_lens[ns] = nd
                    stot += nd
                    ns += 1
                    held += nd
            elif has_spec:
                # the drafts' dict usually lists its requests in this order too: take its
                # next entry when it is this request (no hashing), else look the id up
                d = NULL
                if spec_in_order and spec_next is not NULL and spec_key == <PyObject*>rid:
                    d = spec_next
                    spec_next = NULL
                    if PyDict_Next(spec, &spec_pos, &spec_key, &spec_next) and _items(<object>spec_next, &bitems, &nd):
                        _prefetch(bitems)  # its header was fetched PREFETCH entries ago
                    if PyDict_Next(spec, &ahead_pos, &ahead_key, &ahead_val):
                        _prefetch(ahead_val)
                else:
                    d = PyDict_GetItem(spec, rid)
                    if d is not NULL:
                        spec_in_order = False
                if d is not NULL:  # drafts: a decoding row verifying nd >= 1 of them
                    if not _items(<object>d, &bitems, &nd) or nd < 1 or held - v != 1 or c != 1 + nd \
                            or held + nd >= self.max_model_len or stot + nd > self._spec_ids.shape[0]:
                        return False
                    if _pack(bitems, nd, &self._spec_ids[stot], 0, INT32_MAX + 1, &lo, &hi) != nd:
                        return False
                    spec_sel[ns] = i
                    spec_rows[ns] = r
                    spec_lens[ns] = nd
                    stot += nd
                    ns += 1
                    held += nd
            if seq > held:
                return False
            total += c
            if <object>PyList_GET_ITEM(resumed_from_preemption, i) is not False:
                return False  # resumed (or not a bool): replaces blocks, the numpy path does it
            if _seq_len(<object>PyList_GET_ITEM(new_token_ids, i)) != 0:
                return False
            e = <object>PyList_GET_ITEM(new_block_ids, i)
            if pk:
                if e is not None:
                    return False  # appends in both forms: the vectorized checks word it
                L = 0
                for g in range(G):
                    L += pk_nb[g * n + i]
                if L:  # the packed appends: as the lists below, read from the arrays
                    for g in range(G):
                        L = pk_nb[g * n + i]
                        nb = self.nblocks[g, r] + L
                        if nb > self.maxb[g] or nb * self.capacity[g] < seq or self._ntot[g] + L > self._ids.shape[1]:
                            return False
                        if L and not _copy_in_range(pk_bids + self._pk_off[g], L, &self._ids[g, self._ntot[g]],
                                                    1, self.pool[g]):
                            return False
                        if L and not self._above_bound(g, r, &self._ids[g, self._ntot[g]], L):
                            self._prefetch_held(g, r, self.nblocks[g, r])
                        self._pk_off[g] += L
                        self._start[g, m] = self.nblocks[g, r]
                        self._len[g, m] = L
                        self._ntot[g] += L
                    self._sel[m] = i
                    m += 1
                    e = None
                else:
                    for g in range(G):
                        if <int64_t>self.nblocks[g, r] * self.capacity[g] < seq:
                            return False
            elif e is None:
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
                    if L and not self._above_bound(g, r, &self._ids[g, self._ntot[g]], L):
                        # _appends_distinct reads the row's held ids: start their loads now
                        self._prefetch_held(g, r, self.nblocks[g, r])
                    self._start[g, m] = self.nblocks[g, r]
                    self._len[g, m] = L
                    self._ntot[g] += L
                self._sel[m] = i
                m += 1
            self._rows[i] = r
            self._ncts[i] = v
            self._counts[i] = c
        if m and not self._appends_distinct(m):
            return False  # a block id twice in a row: the numpy path words it
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
        if pk and stot != n_dids:  # drafts the counts do not cover
            return False
        if pk and stot and not _copy_in_range(pk_dids, stot, &self._spec_ids[0], 0, INT32_MAX + 1):
            return False
        if not pk and ns != len(spec):  # drafts for a request that is not a scheduled cached one
            return False
        self._flatten_appends(m)
        self.num_cached, self.num_appends, self.total_tokens = n, m, total
        self.num_spec, self.spec_total = ns, stot
        return True

    cdef bint _packed_offsets(self, Py_ssize_t n, _PackedBuffers pb) noexcept:
        """Check the block counts (``[G, n]``, each ``>= 0``, summing to the ids' length) and
        set ``_pk_off`` to each group's first id (group-major). The draft counts are
        checked as the scan reads them."""
        cdef Py_ssize_t i, g
        cdef int64_t tot = 0, x
        cdef const int32_t* nb = pb.p[2]
        for g in range(self.G):
            self._pk_off[g] = tot
            for i in range(n):
                x = nb[g * n + i]
                if x < 0:
                    return False
                tot += x
        return tot == pb.length[3]

    cdef bint _appends_distinct(self, Py_ssize_t m) noexcept:
        """Each of the ``m`` appending requests' new ids (``_ids``, per group in ``_sel``
        order) repeats neither another of its ids nor one its row holds (``_distinct_append``).
        A row is read only when some appended id is at or below its ``block_id_bound``
        (the scan's loop prefetched those rows' held ids)."""
        cdef Py_ssize_t g, j, off, L, held, r, w
        cdef const int32_t* row
        for g in range(self.G):
            off = 0
            w = self._tab_width[g]
            for j in range(m):
                L = self._len[g, j]
                r = self._rows[self._sel[j]]
                held = min(<Py_ssize_t>self._start[g, j], w)
                if L and self._above_bound(g, r, &self._ids[g, off], L):
                    held = 0  # the row holds no id this large
                row = <const int32_t*><Py_ssize_t>self._tab_addr[g] + r * w
                if L and not _distinct_append(row, held, &self._ids[g, off], L):
                    return False
                off += L
        return True

    cdef inline bint _above_bound(self, Py_ssize_t g, Py_ssize_t r, const int32_t* new, Py_ssize_t L) noexcept:
        """Whether every one of the ``L`` ids ``new`` exceeds row ``r``'s ``block_id_bound`` in group ``g``."""
        cdef int32_t bound = self.idbound[g, r]
        cdef Py_ssize_t t
        for t in range(L):
            if new[t] <= bound:
                return False
        return True

    cdef inline void _prefetch_held(self, Py_ssize_t g, Py_ssize_t r, Py_ssize_t held) noexcept:
        """Prefetch ids ``0 .. held - 1`` of row ``r`` in group ``g`` (64-byte lines)."""
        cdef Py_ssize_t w = self._tab_width[g], u
        cdef Py_ssize_t nbytes = min(held, w) * sizeof(int32_t)
        cdef const char* base = <const char*><Py_ssize_t>self._tab_addr[g] + r * w * sizeof(int32_t)
        for u in range(0, nbytes, 64):
            _prefetch(base + u)

    cdef void _flatten_appends(self, Py_ssize_t m) noexcept:
        """``app_after`` and ``app_flat`` (every group's appended ids back to back) of the
        ``m`` appending requests; ``one_each``: every one appends one block per group."""
        cdef Py_ssize_t g, j, off = 0, L
        cdef bint one = True
        for g in range(self.G):
            for j in range(m):
                L = self._len[g, j]
                self._after[g, j] = self._start[g, j] + L
                if L != 1:
                    one = False
            L = self._ntot[g]
            if L:
                memcpy(&self._flat[off], &self._ids[g, 0], L * sizeof(int32_t))
            off += L
        self.num_appended = off
        self.one_each = one

    def is_scheduled(self, Py_ssize_t row):
        """Whether the last ``scan`` saw a request at ``row``."""
        return 0 <= row < self.max_num_reqs and self.stamp[row] == self.gen
