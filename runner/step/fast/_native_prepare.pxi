# Prepare: prepare_inputs' per-token arithmetic — included by _native.pyx (shares its cimports and helpers)

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
    cdef int32_t[::1] prev_index, prev_pos
    cdef int64_t[::1] pdest, psrc, psteps
    cdef bint patch_bound

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

    def bind_patch(self, prev_index, prev_pos, dest, src, steps):
        """Bind the asynchronous patch's columns for :meth:`prepare_patched`:
        ``prev_index`` / ``prev_pos`` ``[max_num_reqs]`` ``int32`` (the batch's
        ``prev_sampled_index`` / ``prev_sampled_pos``), ``dest`` / ``src``
        ``[max_num_reqs]`` ``int64`` (``PrepareBuffers.patch_dest`` / ``patch_src``),
        ``steps`` ``[2]`` ``int64`` (``PrepareBuffers.patch_steps``: slice, scatter)."""
        if steps.shape[0] != 2:
            raise ValueError("Prepare.bind_patch: steps holds 2 counters")
        self.prev_index, self.prev_pos, self.pdest, self.psrc = prev_index, prev_pos, dest, src
        self.psteps = steps
        self.patch_bound = True

    def prepare(self, Py_ssize_t R, Py_ssize_t P):
        """Fill the buffers for ``R`` rows, padding the token dimension to ``P`` (``P <
        num_actual_tokens`` means no padding).

        Returns:
            ``(num_actual_tokens, max_query_len, max_seq_len)``.

        Raises:
            IndexError: a row's scheduled positions leave the token table, a token
                buffer would overflow, or a position's block lies outside its row (the
                step compiler's validation excludes all three).
            PlaceholderRead: (``args[0]``: the token's index) a token read from the table
                is a placeholder (a negative id: a sampled token that was neither patched
                nor filled); the buffers are written, nothing else.
        """
        cdef int64_t maxq = 0, maxs = 0
        cdef Py_ssize_t Q = self._rows(R, &maxq, &maxs)
        cdef Py_ssize_t bad = self._gather(Q, P, 0, NULL, False, R, maxq)
        self._slots(R, Q, P, maxq)
        if bad >= 0:
            raise PlaceholderRead(bad)
        return Q, maxq, maxs

    def prepare_patched(self, Py_ssize_t R, Py_ssize_t P, size_t prev_addr, Py_ssize_t prev_len,
                        Py_ssize_t expected):
        """:meth:`prepare` and the asynchronous patch (``StepKernels.prepare_patched``) in one
        call: a loop after the row loop plans the patch into ``dest`` / ``src`` (rows whose
        ``prev_sampled_index`` is set and whose placeholder lies in this step's tokens);
        with ``prev_addr`` (the address of the previous step's ``prev_len`` sampled
        tokens on the host, a C-contiguous ``int64`` vector the caller keeps alive) the
        gather writes those tokens and skips the token table's placeholders. Needs
        :meth:`bind_patch`.

        The patch is applied, rows ``0 .. R - 1``'s ``prev_sampled_index`` consumed (-1)
        and the step counted in ``steps`` (when ``k > 0``), only when the step is the one the caller checks next: ``num_actual_tokens
        == expected`` (``expected = -1``: no check) and ``P`` is no padding below it
        (``P < 0`` or ``P >= num_actual_tokens``); else nothing is patched (``k = 0``)
        and the columns stay as they were, the buffers as :meth:`prepare` leaves them.

        Returns:
            ``(num_actual_tokens, max_query_len, max_seq_len, k, contiguous, written)``:
            ``dest[:k]`` / ``src[:k]`` hold the patch unless ``contiguous`` (``dest == src
            == arange(k)``: not written); ``written``: the tokens were written into
            ``input_ids``.

        ``prev_len`` is checked against the patch's largest source index whether or not
        ``prev_addr`` is given; with it, each token taken is checked in ``[0, 2**31)``.

        Raises:
            IndexError: as :meth:`prepare`.
            ValueError: a source index outside the previous step's ``prev_len`` tokens, or
                a token taken from ``prev_addr`` outside ``[0, 2**31)``.
            PlaceholderRead: as :meth:`prepare`, for a token outside the patch.
            All three before any column is consumed.
        """
        if not self.patch_bound:
            raise RuntimeError("Prepare.prepare_patched before bind_patch")
        if R > self.prev_index.shape[0] or prev_len < 0:
            raise IndexError(f"Prepare.prepare_patched: {R} rows")
        cdef int64_t maxq = 0, maxs = 0
        cdef Py_ssize_t Q = self._rows(R, &maxq, &maxs), k
        cdef int64_t smax = -1
        cdef bint contiguous = True, written = prev_addr != 0
        if (expected >= 0 and Q != expected) or (0 <= P < Q):
            self._gather(Q, P, 0, NULL, False, R, maxq)  # the caller refuses this step: no patch (nor
            self._slots(R, Q, P, maxq)                # a placeholder check: the refusal is the error)
            return Q, maxq, maxs, 0, True, False
        k = self._plan_patch(R, &contiguous, &smax)
        if smax >= prev_len:  # (contiguous: smax = k - 1)
            raise ValueError(f"holds {prev_len} tokens but a placeholder takes entry {smax}")
        cdef Py_ssize_t bad = self._gather(Q, P, k, <const int64_t*>prev_addr if written else NULL, contiguous, R, maxq)
        self._slots(R, Q, P, maxq)
        if bad >= 0:
            raise PlaceholderRead(bad)
        if R:
            memset(&self.prev_index[0], 0xFF, R * sizeof(int32_t))  # consumed: -1 in every row
        if k:
            self.psteps[0 if contiguous else 1] += 1
        return Q, maxq, maxs, k, contiguous, written

    cdef Py_ssize_t _plan_patch(self, Py_ssize_t R, bint* contiguous_out, int64_t* smax_out) except -1:
        """The patch's plan after :meth:`_rows` (which wrote ``query_start_loc``): rows whose
        ``prev_sampled_index`` is set and whose placeholder is one of this step's tokens,
        into ``pdest`` / ``psrc`` (``dest`` ascending). Its own loop: the row loop stays the
        one of a synchronous step. Returns ``k``; ``contiguous_out``: ``dest == src ==
        arange(k)``, in which case ``pdest`` / ``psrc`` are not written (a decode step's
        patch stores nothing); ``smax_out``: the largest source index (-1 when ``k = 0``)."""
        cdef const int32_t* pidx = &self.prev_index[0]
        cdef const int32_t* ppos = &self.prev_pos[0]
        cdef const int32_t* ncc = &self.ncc[0]
        cdef const int32_t* sched = &self.sched[0]
        cdef const int32_t* qsl = &self.qsl[0]
        cdef int64_t* pdest = &self.pdest[0]
        cdef int64_t* psrc = &self.psrc[0]
        cdef Py_ssize_t r, j, k = 0
        cdef int64_t s, off, d, smax = -1
        cdef bint contiguous = True
        if R and _rows_in_order(R, pidx, ppos, ncc, qsl):
            contiguous_out[0] = True  # the general loop below would find the same
            smax_out[0] = R - 1
            return R
        for r in range(R):
            s = pidx[r]
            if s >= 0:
                off = <int64_t>ppos[r] - ncc[r]
                if 0 <= off < sched[r]:  # its placeholder is one of this step's tokens
                    d = qsl[r] + off
                    if contiguous:
                        if d == k and s == k:  # still arange(k): nothing to store
                            k += 1
                            continue
                        contiguous = False  # the plan so far was arange(k): write it out
                        for j in range(k):
                            pdest[j] = j
                            psrc[j] = j
                    pdest[k] = d
                    psrc[k] = s
                    if s > smax:
                        smax = s
                    k += 1
        contiguous_out[0] = contiguous
        smax_out[0] = k - 1 if contiguous else smax
        return k

    cdef Py_ssize_t _rows(self, Py_ssize_t R, int64_t* maxq_out, int64_t* maxs_out) except -1:
        """The per-row loop: each row's token rows, positions, counts and masks.
        Returns ``num_actual_tokens``."""
        cdef Py_ssize_t r, t, Q = 0, q, maxq = 0, maxs = 0
        cdef int64_t c
        cdef Py_ssize_t width = self.tokens.shape[1], cap = self.positions.shape[0]
        if R > self.sched.shape[0]:
            raise IndexError(f"{R} rows but the batch holds {self.sched.shape[0]}")
        # local pointers: the compiler cannot prove the buffers do not alias, so reading
        # them through the memoryview structs would reload every field after every store
        cdef int32_t* sched = &self.sched[0]
        cdef int32_t* ncc = &self.ncc[0]
        cdef int32_t* qsl = &self.qsl[0]
        cdef int64_t* positions = &self.positions[0]
        cdef int64_t* req = &self.req_indices[0]
        cdef int32_t* seq_lens = &self.seq_lens[0]
        cdef int64_t* logits_indices = &self.logits_indices[0]
        cdef uint8_t* discard = &self.discard[0]
        cdef uint8_t* is_prefilling = &self.is_prefilling[0]
        cdef const int32_t* num_tokens = &self.num_tokens[0]
        cdef const int32_t* num_prompt = &self.num_prompt[0]
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
            seq_lens[r] = <int32_t>(c + q)
            logits_indices[r] = Q - 1
            discard[r] = (c + q) < num_tokens[r]
            is_prefilling[r] = c < num_prompt[r]
            if q > maxq:
                maxq = q
            if c + q > maxs:
                maxs = c + q
        maxq_out[0] = maxq
        maxs_out[0] = maxs
        return Q

    cdef Py_ssize_t _gather(self, Py_ssize_t Q, Py_ssize_t P, Py_ssize_t k, const int64_t* host,
                            bint contiguous, Py_ssize_t R, int64_t maxq) except -2:
        """``input_ids`` of the ``Q`` tokens of rows ``0 .. R - 1`` (the longest query
        ``maxq``) from the token table, then the padding to ``P``. Without a patch, rows
        averaging two tokens or more (drafts, prefill chunks) are copied row by row (a row's
        tokens are consecutive in its table row; equal widths 2-5 compiled as constants),
        others token by token. The ``k`` patched tokens (``pdest`` ascending; ``contiguous``: ``pdest == psrc
        == arange(k)``, e.g. a decode step) come from ``host[psrc]``, each checked in ``[0,
        2**31)`` (their table entries, placeholders, are not read), or, without ``host`` (the
        caller patches them on the device), from the table. Returns the index of the first
        other token that is a placeholder (a negative id), or -1; raises ``ValueError`` for
        a host token out of range."""
        cdef Py_ssize_t t, j, end, cap = self.positions.shape[0], width = self.tokens.shape[1]
        cdef int32_t* ids = &self.input_ids[0]
        cdef const int32_t* tok = &self.tokens[0, 0]
        cdef const int64_t* req = &self.req_indices[0]
        cdef int64_t* positions = &self.positions[0]
        cdef const int64_t* dest
        cdef const int64_t* src
        cdef int32_t v, neg = 0  # the OR of the unpatched tokens: negative iff one is a placeholder
        cdef int64_t h
        cdef uint64_t bits = 0
        if P > cap:
            raise IndexError(f"padding to {P} tokens but the buffers hold {cap}")
        if k == 0 and Q >= 2 * R:
            neg = self._gather_rows(R, maxq if Q == R * maxq else 0, ids)
        elif k == 0:
            for t in range(Q):  # the gather, in its own loop: independent loads overlap
                v = tok[req[t] * width + positions[t]]
                ids[t] = v
                neg |= v
        elif contiguous:  # the first k tokens are the patched ones
            if host is not NULL:
                for t in range(k):  # a copy (vectorised): the range check ORs the values
                    h = host[t]
                    ids[t] = <int32_t>h
                    bits |= <uint64_t>h  # a value outside [0, 2**31) sets a bit from 31 up
                if bits >> 31:
                    for t in range(k):
                        self._patched(host, t, t)  # raises at the first one
            else:
                for t in range(k):
                    ids[t] = tok[req[t] * width + positions[t]]
            for t in range(k, Q):
                v = tok[req[t] * width + positions[t]]
                ids[t] = v
                neg |= v
        else:
            dest, src = &self.pdest[0], &self.psrc[0]
            t = 0
            for j in range(k + 1):  # the runs between patched tokens, then the patched one
                end = dest[j] if j < k else Q
                while t < end:
                    v = tok[req[t] * width + positions[t]]
                    ids[t] = v
                    neg |= v
                    t += 1
                if j < k:
                    ids[t] = self._patched(host, src[j], t)
                    t += 1
        for t in range(Q, P):
            positions[t] = 0
            ids[t] = 0
        if neg >= 0:
            return -1
        return self._first_placeholder(Q, k, contiguous)

    cdef int32_t _gather_rows(self, Py_ssize_t R, Py_ssize_t w, int32_t* ids) noexcept:
        """:meth:`_gather` row by row (``w > 0``: every row holds ``w`` tokens); returns the
        OR of the tokens (negative iff one is a placeholder)."""
        cdef const int32_t* qsl = &self.qsl[0]
        cdef const int32_t* ncc = &self.ncc[0]
        cdef const int32_t* tok = &self.tokens[0, 0]
        cdef Py_ssize_t width = self.tokens.shape[1]
        if w == 2:
            return _copy_rows(R, 2, qsl, ncc, tok, width, ids)
        if w == 3:
            return _copy_rows(R, 3, qsl, ncc, tok, width, ids)
        if w == 4:
            return _copy_rows(R, 4, qsl, ncc, tok, width, ids)
        if w == 5:
            return _copy_rows(R, 5, qsl, ncc, tok, width, ids)
        return _copy_rows(R, 0, qsl, ncc, tok, width, ids)

    cdef inline int32_t _patched(self, const int64_t* host, Py_ssize_t s, Py_ssize_t t) except? -1:
        """Token ``t``'s patched id: ``host[s]`` checked, or without ``host`` its table entry."""
        cdef int64_t h
        if host is NULL:
            return self.tokens[self.req_indices[t], self.positions[t]]
        h = host[s]
        if h < 0 or h > INT32_MAX:
            raise ValueError(f"entry {s} is {h}, not a token id in [0, 2**31)")
        return <int32_t>h

    cdef Py_ssize_t _first_placeholder(self, Py_ssize_t Q, Py_ssize_t k, bint contiguous) noexcept:
        """The first of the ``Q`` tokens outside the ``k`` patched ones (as :meth:`_gather`)
        whose id is negative, or -1."""
        cdef const int32_t* ids = &self.input_ids[0]
        cdef const int64_t* dest = NULL
        cdef Py_ssize_t t, j = 0
        if k and not contiguous:
            dest = &self.pdest[0]
        for t in range(k if contiguous else 0, Q):
            if dest is not NULL and j < k and dest[j] == t:
                j += 1
                continue
            if ids[t] < 0:
                return t
        return -1

    cdef int _row_slots(self, Py_ssize_t g, Py_ssize_t R, const int32_t* tb, Py_ssize_t ncols, int64_t sh,
                        Py_ssize_t w, int64_t* slots) except -1:
        """Group ``g``'s slot mapping row by row (a power-of-two block size ``1 << sh``):
        a row's tokens are consecutive positions from ``positions[qsl[r]]``, so a row
        whose positions stay in one block reads one block-table entry and stores an
        arithmetic sequence; a row that crosses a block reads one entry per token. ``w >
        0``: every row holds ``w`` tokens (``Q == R * max_query_len``; the usual widths are
        compiled as constants, so the per-row stores unroll), else ``0``."""
        cdef const int32_t* qsl = &self.qsl[0]
        cdef const int64_t* positions = &self.positions[0]
        cdef Py_ssize_t bad
        if w == 2:
            bad = _slot_rows(R, 2, qsl, positions, tb, ncols, sh, slots)
        elif w == 3:
            bad = _slot_rows(R, 3, qsl, positions, tb, ncols, sh, slots)
        elif w == 4:
            bad = _slot_rows(R, 4, qsl, positions, tb, ncols, sh, slots)
        elif w == 5:
            bad = _slot_rows(R, 5, qsl, positions, tb, ncols, sh, slots)
        else:
            bad = _slot_rows(R, 0, qsl, positions, tb, ncols, sh, slots)
        if bad >= 0:
            raise IndexError(f"group {g}: position {positions[qsl[bad]] + qsl[bad + 1] - qsl[bad] - 1} "
                             "lies past the block table")
        return 0

    cdef int _slots(self, Py_ssize_t R, Py_ssize_t Q, Py_ssize_t P, int64_t maxq) except -1:
        """Every group's slot mapping of the ``Q`` tokens of rows ``0 .. R - 1`` (the longest
        query ``maxq``), padded to ``P`` with ``PAD_SLOT``. Token by token when the rows hold
        fewer than two tokens each on average (a decode step: the per-token loop is the
        faster one there), else row by row (:meth:`_row_slots`: drafts, prefill chunks;
        same bytes)."""
        cdef Py_ssize_t t, g, col, ncols
        cdef int64_t pos, B, shift
        cdef int32_t[:, ::1] tab
        cdef int64_t[::1] sm
        cdef const int32_t* tb
        cdef int64_t* slots
        cdef const int64_t* positions = &self.positions[0]
        cdef const int64_t* req = &self.req_indices[0]
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
            if shift >= 0 and Q >= 2 * R:
                self._row_slots(g, R, tb, ncols, shift, maxq if Q == R * maxq else 0, slots)
                for t in range(Q, P):
                    slots[t] = PAD_SLOT
                continue
            for t in range(Q):
                pos = positions[t]
                col = (pos >> shift) if shift >= 0 else pos // B
                if col >= ncols:
                    raise IndexError(f"group {g}: position {pos} lies past the block table")
                slots[t] = <int64_t>tb[req[t] * ncols + col] * B + (pos - col * B)
            for t in range(Q, P):
                slots[t] = PAD_SLOT
        return 0
