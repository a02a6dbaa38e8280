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
