# NewScan: scheduled_new_reqs in one pass — included by _native.pyx (shares its cimports and helpers)

cdef class NewScan:
    """Validate-then-admit of a step's fresh requests (``scheduled_new_reqs``) for one
    ``InputBatch``, bound to its columns and block tables.

    ``scan`` reads the ``NewRequestData`` objects, checks them and stages their tokens,
    counts, sampling columns and block ids in its own buffers; ``write_rows`` then writes
    the staged requests into their (vacant) batch rows. Regular means: a non-empty prompt
    and outputs as lists or tuples of ints in ``[0, 2**31)`` that fit ``max_model_len``;
    ``num_computed_tokens`` an ``int >= 0`` with ``num_computed_tokens + count`` within
    the tokens held; per group a list of distinct ints in ``[1, pool)`` (no null block) that fits
    a row and covers ``seq_len``; ``SamplingParams`` (exactly) with a ``temperature`` in
    ``[0, float32 max]`` and ``top_p`` in ``(0, 1]`` (``float`` or ``int``), an ``int32``
    ``top_k`` and a ``seed`` that is ``None`` or an ``int64``. Anything else: ``scan``
    returns ``False``.

    Args:
        tokens: the ``[max_num_reqs, max_model_len]`` ``int32`` token table.
        num_tokens, num_prompt_tokens, num_computed_tokens, num_scheduled_tokens, nulled,
            top_k: ``[max_num_reqs]`` ``int32`` columns; temperature, top_p: ``float32``.
        num_blocks_per_row: ``[G, max_num_reqs]`` ``int32``.
        block_id_bound: ``[G, max_num_reqs]`` ``int32`` (``BlockTable.block_id_bound``): a
            written row's is the largest id written.
        block_tables, kernel_tables, kernel_blocks_per_block: per group, as ``CachedScan``.
        capacity: per group, tokens one block covers (0: any length, a Mamba state group).
        pool: per group, the exclusive upper bound of block ids.
        sampling_params_type: the ``SamplingParams`` class (exact type required).
    """

    cdef int32_t[:, ::1] tokens
    cdef int32_t[::1] num_tokens, num_prompt, ncc, sched, nulled, top_k
    cdef float[::1] temperature, top_p
    cdef int32_t[:, ::1] nblocks, idbound
    cdef list tables, ktables
    cdef int64_t[::1] kpb, capacity, pool, maxb
    cdef int G, M
    cdef object sp_type
    cdef int32_t[::1] _tok
    cdef int32_t[:, ::1] _blk
    cdef int64_t[::1] _tok_off, _tok_len, _nprompt, _ncts, _count, _topk
    cdef double[::1] _temp, _topp
    cdef int64_t[:, ::1] _blk_off, _blk_len
    cdef int64_t[::1] _boff
    cdef int32_t[::1] _scratch
    cdef readonly Py_ssize_t num_new

    def __init__(self, tokens, num_tokens, num_prompt_tokens, num_computed_tokens, num_scheduled_tokens, nulled,
                 temperature, top_k, top_p, num_blocks_per_row, block_id_bound, list block_tables, list kernel_tables,
                 kernel_blocks_per_block, capacity, pool, sampling_params_type):
        self.tokens = tokens
        self.num_tokens, self.num_prompt, self.ncc = num_tokens, num_prompt_tokens, num_computed_tokens
        self.sched, self.nulled = num_scheduled_tokens, nulled
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.nblocks = num_blocks_per_row
        self.idbound = block_id_bound
        self.G, self.M = self.nblocks.shape[0], self.nblocks.shape[1]
        self.tables, self.ktables = block_tables, kernel_tables
        self.kpb = np.asarray(kernel_blocks_per_block, dtype=np.int64)
        self.capacity = np.asarray(capacity, dtype=np.int64)
        self.pool = np.asarray(pool, dtype=np.int64)
        self.maxb = np.asarray([t.shape[1] for t in block_tables], dtype=np.int64)
        self.sp_type = sampling_params_type
        self._tok = np.zeros(1 << 16, np.int32)
        self._blk = np.zeros((self.G, 1 << 12), np.int32)
        M = self.M
        self._tok_off, self._tok_len, self._nprompt, self._ncts, self._count, self._topk = (
            np.zeros(M, np.int64) for _ in range(6))
        self._temp, self._topp = np.zeros(M, np.float64), np.zeros(M, np.float64)
        self._blk_off, self._blk_len = np.zeros((self.G, M), np.int64), np.zeros((self.G, M), np.int64)
        self._boff = np.zeros(self.G, np.int64)
        self._scratch = np.zeros(max([t.shape[1] for t in block_tables] + [1]), np.int32)

    def scan(self, list new_reqs, list new_counts):
        """Check and stage ``new_reqs`` (their counts already checked ``>= 1``); change
        nothing in the batch.

        Memory safety against arbitrary objects: the lists are copied first, and a
        sequence's item array is taken right before it is read, with no Python code
        (attribute access, allocation) in between.

        Returns:
            ``True`` when every request is regular (see the class docstring), else ``False``.
        """
        cdef list reqs = list(new_reqs), counts = list(new_counts)
        cdef Py_ssize_t k = len(reqs), i, g, n_p, n_o, held, off = 0, n, n2
        cdef Py_ssize_t max_len = self.tokens.shape[1]
        cdef int64_t v, c, seq, tk, lo, hi, seed
        cdef double t, p
        cdef object nr, prompt, outs, sp, lst, x
        cdef tuple blocks
        cdef PyObject** items
        cdef int64_t[::1] boff = self._boff
        if k > self.M or len(counts) != k:
            return False
        for g in range(self.G):
            boff[g] = 0
        for i in range(k):
            nr = reqs[i]
            # every attribute first (any of them may run Python code) ...
            prompt, outs, blocks = nr.prompt_token_ids, nr.output_token_ids, None
            x = nr.block_ids
            if type(x) is tuple or type(x) is list:
                blocks = tuple(x)  # our own: its lists stay alive while we read them
            if (blocks is None or len(blocks) != self.G or not _exact_int(nr.num_computed_tokens, &v)
                    or v < 0 or not _exact_int(counts[i], &c) or c < 1):
                return False
            sp = nr.sampling_params
            if type(sp) is not self.sp_type or not _real(sp.temperature, &t) or not (0 <= t <= FLOAT32_MAX) \
                    or not _real(sp.top_p, &p) or not (0 < p <= 1) \
                    or not _exact_int(sp.top_k, &tk) or tk < -INT32_MAX - 1 or tk > INT32_MAX:
                return False
            x = sp.seed
            if x is not None and not _exact_int(x, &seed):  # torch.Generator takes any int64
                return False
            # ... then sizes, room, and the reads (no Python code between _items and _pack)
            n_p, n_o = _token_len(prompt), _token_len(outs)
            if n_p < 1 or n_o < 0:
                return False
            held = n_p + n_o
            seq = v + c
            if held > max_len or seq > held:
                return False
            if off + held > self._tok.shape[0]:
                grown = np.zeros(max(2 * self._tok.shape[0], off + held), np.int32)
                grown[:off] = np.asarray(self._tok)[:off]
                self._tok = grown
            if not _pack_tokens(prompt, n_p, &self._tok[off]) or (
                    n_o and not _pack_tokens(outs, n_o, &self._tok[off + n_p])):
                return False
            self._tok_off[i], self._tok_len[i], self._nprompt[i] = off, held, n_p
            self._ncts[i], self._count[i] = v, c
            self._temp[i], self._topp[i], self._topk[i] = t, p, tk
            off += held
            for g in range(self.G):
                lst = blocks[g]
                if not _items(lst, &items, &n):
                    return False
                if n > self.maxb[g] or (self.capacity[g] > 0 and n * self.capacity[g] < seq):
                    return False
                if boff[g] + n > self._blk.shape[1]:
                    grown = np.zeros((self.G, max(2 * self._blk.shape[1], boff[g] + n)), np.int32)
                    grown[:, :self._blk.shape[1]] = np.asarray(self._blk)
                    self._blk = grown
                if n and (not _items(lst, &items, &n2) or n2 != n
                          or _pack(items, n, &self._blk[g, boff[g]], 1, self.pool[g], &lo, &hi) != n):
                    return False
                if n > 1 and not _distinct(&self._blk[g, boff[g]], n, &self._scratch[0]):
                    return False  # a block id twice in one list: the numpy path words it
                self._blk_off[g, i], self._blk_len[g, i] = boff[g], n
                boff[g] += n
        self.num_new = k
        return True

    def write_rows(self, list rows):
        """Write the requests of the last successful ``scan`` into ``rows`` (vacant rows,
        Python ints, one per request in order): tokens, counts, sampling columns, block ids
        and their kernel expansion.

        Raises:
            IndexError: a row outside the batch, or fewer rows than requests (nothing is
                written then).
        """
        cdef Py_ssize_t i, r, g, j, t, off, n, q
        cdef int64_t k, b, hi
        cdef int32_t[:, ::1] tab, ktab
        if len(rows) != self.num_new:
            raise IndexError(f"{len(rows)} rows for {self.num_new} staged requests")
        for i in range(self.num_new):
            r = rows[i]
            if r < 0 or r >= self.M:
                raise IndexError(f"row {r} is outside the batch ({self.M} rows)")
        for i in range(self.num_new):
            r = rows[i]
            off, n = self._tok_off[i], self._tok_len[i]
            for t in range(n):
                self.tokens[r, t] = self._tok[off + t]
            self.num_tokens[r] = <int32_t>n
            self.num_prompt[r] = <int32_t>self._nprompt[i]
            self.ncc[r] = <int32_t>self._ncts[i]
            self.sched[r] = <int32_t>self._count[i]
            self.nulled[r] = 0
            self.temperature[r] = <float>self._temp[i]
            self.top_p[r] = <float>self._topp[i]
            self.top_k[r] = <int32_t>self._topk[i]
        for g in range(self.G):
            tab = self.tables[g]
            ktab = self.ktables[g]
            k = self.kpb[g]
            for i in range(self.num_new):
                r = rows[i]
                off, n = self._blk_off[g, i], self._blk_len[g, i]
                hi = 0
                for j in range(n):
                    b = self._blk[g, off + j]
                    tab[r, j] = <int32_t>b
                    if b > hi:
                        hi = b
                    if k > 1:
                        for q in range(k):
                            ktab[r, j * k + q] = <int32_t>(b * k + q)
                self.nblocks[g, r] = <int32_t>n
                self.idbound[g, r] = <int32_t>hi  # (the row was vacant: these are all its ids)
