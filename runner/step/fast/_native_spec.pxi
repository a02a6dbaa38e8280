# DraftRows, SpecLayout and Patch: speculative decoding's drafts and the asynchronous patch — included by
# _native.pyx (shares its cimports and helpers)

cdef class DraftRows:
    """Stage 2 of a step with drafts: they go after their rows' tokens. Bound to the
    batch's ``[max_num_reqs, max_model_len]`` ``int32`` token table and its ``num_tokens``
    and ``num_spec_tokens`` ``[max_num_reqs]`` ``int32`` columns."""

    cdef int32_t[:, ::1] tokens
    cdef int32_t[::1] num_tokens, num_spec

    def __init__(self, tokens, num_tokens, num_spec):
        self.tokens, self.num_tokens, self.num_spec = tokens, num_tokens, num_spec

    def write(self, const int64_t[::1] rows, const int64_t[::1] lens, const int32_t[::1] flat):
        """Clear every row's draft count, then put row ``rows[i]``'s ``lens[i]`` drafts
        (``flat``, request after request) after its ``num_tokens`` tokens.

        Raises:
            IndexError: a row outside the batch, or drafts past the token table or ``flat``
                (checked before anything is written).
        """
        cdef Py_ssize_t i, n = rows.shape[0], M = self.num_spec.shape[0], W = self.tokens.shape[1], off = 0
        cdef int64_t r, L, h, L0 = 0
        cdef bint same = True  # every row verifies L0 drafts (a fixed num_speculative_tokens)
        if lens.shape[0] != n:
            raise IndexError("DraftRows.write: rows and lens differ in length")
        if n:
            L0 = lens[0]
        for i in range(n):
            r, L = rows[i], lens[i]
            if r < 0 or r >= M or L < 0:
                raise IndexError(f"DraftRows.write: row {r} / {L} drafts")
            h = self.num_tokens[r]
            if h + L > W or off + L > flat.shape[0]:
                raise IndexError(f"DraftRows.write: row {r}'s drafts leave the token table")
            off += L
            same &= L == L0
        memset(&self.num_spec[0], 0, M * sizeof(int32_t))
        if n == 0:
            return
        cdef int32_t* tok = &self.tokens[0, 0]
        cdef const int32_t* ntok = &self.num_tokens[0]
        cdef int32_t* nspec = &self.num_spec[0]
        cdef const int32_t* src = &flat[0] if flat.shape[0] else NULL
        cdef const int64_t* rp = &rows[0]
        cdef const int64_t* lp = &lens[0]
        # the usual draft counts as constants: the compiler unrolls the per-row copy
        if same and L0 == 1:
            _draft_rows(n, rp, lp, 1, src, tok, W, ntok, nspec)
        elif same and L0 == 2:
            _draft_rows(n, rp, lp, 2, src, tok, W, ntok, nspec)
        elif same and L0 == 3:
            _draft_rows(n, rp, lp, 3, src, tok, W, ntok, nspec)
        elif same and L0 == 4:
            _draft_rows(n, rp, lp, 4, src, tok, W, ntok, nspec)
        else:
            _draft_rows(n, rp, lp, -1, src, tok, W, ntok, nspec)


cdef inline void _draft_rows(Py_ssize_t n, const int64_t* rows, const int64_t* lens, int64_t L0, const int32_t* src,
                             int32_t* tok, Py_ssize_t W, const int32_t* ntok, int32_t* nspec) noexcept:
    """``DraftRows.write``'s stores (checked before): row ``rows[i]`` gets ``lens[i]`` drafts
    from ``src`` (request after request) after its ``ntok`` tokens, and that count in
    ``nspec``. ``L0 >= 0``: every row has ``L0`` (a constant at each call: the copy unrolls)."""
    cdef Py_ssize_t i, j, off = 0
    cdef int64_t r, L
    cdef int32_t* dst
    for i in range(n):
        r = rows[i]
        L = L0 if L0 >= 0 else lens[i]
        dst = tok + r * W + ntok[r]
        for j in range(L):
            dst[j] = src[off + j]
        nspec[r] = <int32_t>L
        off += L



cdef inline void _uniform_rows(Py_ssize_t R, Py_ssize_t d, const int32_t* ids, int64_t* logits, int64_t* target,
                               int64_t* draft_ids, int64_t* bonus, int64_t* cu) noexcept:
    """``SpecLayout._uniform``'s stores: row ``r`` owns tokens ``[r (1 + d), (r + 1)(1 + d))``,
    its logits ``r (1 + d) + 0 .. d``, its drafts' targets ``r (1 + d) + 0 .. d - 1`` and ids
    (the tokens after its first), its bonus ``r (1 + d) + d``. Inline: each call with a
    constant ``d`` is compiled with its inner loops unrolled."""
    cdef Py_ssize_t r, j, q, o = 0
    for r in range(R):
        q = r * (d + 1)
        for j in range(d + 1):
            logits[q + j] = q + j
        for j in range(d):
            target[o + j] = q + j
            draft_ids[o + j] = ids[q + 1 + j]
        o += d
        bonus[r] = q + d
        cu[r] = o


cdef class SpecLayout:
    """Stage 3 of a step with drafts: the verification layout (``runner/step/spec_metadata.py``).

    Args:
        num_spec: the batch's ``[max_num_reqs]`` ``int32`` ``num_spec_tokens``.
        qsl: ``[max_num_reqs + 1]`` ``int32`` ``query_start_loc`` (host).
        discard: ``[max_num_reqs]`` ``bool``.
        input_ids: ``[T]`` ``int32`` (host).
        logits, target, bonus, cu, draft_ids: ``int64`` outputs of :meth:`layout`
            (``[T]``, ``[T]``, ``[max_num_reqs]``, ``[max_num_reqs]``, ``[T]``).
    """

    cdef int32_t[::1] num_spec, qsl, input_ids
    cdef uint8_t[::1] discard
    cdef int64_t[::1] logits, target, bonus, cu, draft_ids

    def __init__(self, num_spec, qsl, discard, input_ids, logits, target, bonus, cu, draft_ids):
        self.num_spec, self.qsl, self.discard, self.input_ids = num_spec, qsl, discard.view(np.uint8), input_ids
        self.logits, self.target, self.bonus, self.cu, self.draft_ids = logits, target, bonus, cu, draft_ids

    cdef bint _uniform(self, Py_ssize_t R, int64_t d, Py_ssize_t T, Py_ssize_t nid) noexcept:
        """The common steady step: every one of the ``R`` rows kept, verifying ``d >= 1``
        drafts with a query of exactly ``1 + d`` tokens. Then the layout is a fixed pattern
        of ``(R, d)`` (row ``i``'s tokens are ``[i (1 + d), (i + 1)(1 + d))``), filled by
        loops without per-row branches. Returns False (nothing written) otherwise. (On a
        validated step equal counts imply the rest: a verifying row is scheduled ``1 + d``
        tokens and never discarded; both are checked anyway, as every index here.)"""
        cdef const int32_t* nspec = &self.num_spec[0]
        cdef const int32_t* qsl = &self.qsl[0]
        cdef const uint8_t* discard = &self.discard[0]
        cdef Py_ssize_t r, w = d + 1, n = R * (d + 1)
        if d < 1 or n > T or n > nid or qsl[0] != 0:
            return False
        for r in range(R):
            if discard[r] | (nspec[r] != d) | (qsl[r + 1] != (r + 1) * w):
                return False
        cdef const int32_t* ids = &self.input_ids[0]
        cdef int64_t* logits = &self.logits[0]
        cdef int64_t* target = &self.target[0]
        cdef int64_t* draft_ids = &self.draft_ids[0]
        cdef int64_t* bonus = &self.bonus[0]
        cdef int64_t* cu = &self.cu[0]
        # the usual draft counts as constants: the compiler unrolls the per-row stores
        if d == 1:
            _uniform_rows(R, 1, ids, logits, target, draft_ids, bonus, cu)
        elif d == 2:
            _uniform_rows(R, 2, ids, logits, target, draft_ids, bonus, cu)
        elif d == 3:
            _uniform_rows(R, 3, ids, logits, target, draft_ids, bonus, cu)
        elif d == 4:
            _uniform_rows(R, 4, ids, logits, target, draft_ids, bonus, cu)
        else:
            _uniform_rows(R, d, ids, logits, target, draft_ids, bonus, cu)
        return True

    def layout(self, Py_ssize_t R):
        """Fill the spec buffers for the kept rows (``~discard``) of rows ``0 .. R - 1``
        (``runner/step/spec_metadata.py``: ``logits_indices``, ``target_logits_indices``,
        ``bonus_logits_indices``, ``cu_num_draft_tokens``, ``draft_token_ids`` read from the
        host ``input_ids``).

        Returns:
            ``(num_kept, num_drafts, counts)``: ``counts`` the kept rows' draft counts (a list).

        Raises:
            IndexError: a row's query shorter than ``1 + d`` or a buffer too small (the
                step's validation excludes both).
        """
        cdef Py_ssize_t r, j, k = 0, D = 0, L = 0, T = self.logits.shape[0], nid = self.input_ids.shape[0]
        cdef int64_t d, end
        cdef list counts
        if R > self.num_spec.shape[0] or R > self.bonus.shape[0] or R > self.cu.shape[0] \
                or self.target.shape[0] < T or self.draft_ids.shape[0] < T:
            raise IndexError(f"SpecLayout.layout: {R} rows")
        if R == 0:
            return 0, 0, []
        # local pointers: through the memoryview structs the compiler would reload every
        # field after every store (it cannot prove the buffers do not alias)
        cdef const int32_t* nspec = &self.num_spec[0]
        cdef const int32_t* qsl = &self.qsl[0]
        cdef const uint8_t* discard = &self.discard[0]
        cdef const int32_t* ids = &self.input_ids[0]
        cdef int64_t* logits = &self.logits[0]
        cdef int64_t* target = &self.target[0]
        cdef int64_t* draft_ids = &self.draft_ids[0]
        cdef int64_t* bonus = &self.bonus[0]
        cdef int64_t* cu = &self.cu[0]
        d = nspec[0]
        if self._uniform(R, d, T, nid):
            return R, R * d, [d] * R
        for r in range(R):
            if discard[r]:
                continue
            d = nspec[r]
            end = qsl[r + 1]
            if d < 0 or end - d - 1 < qsl[r] or L + d + 1 > T or end > nid:
                raise IndexError(f"SpecLayout.layout: row {r}: {d} drafts in its query")
            for j in range(d + 1):
                logits[L + j] = end - d - 1 + j
            for j in range(d):
                target[D + j] = L + j
                draft_ids[D + j] = ids[end - d + j]
            L += d + 1
            D += d
            bonus[k] = L - 1
            cu[k] = D
            k += 1
        # the kept rows' counts: the differences of cu (a list, read without a sync); when
        # every kept row verifies the same number (a fixed num_speculative_tokens, the usual
        # case) one repeated int, without an int object per row
        d = cu[0]
        if D == d * k:
            for j in range(1, k):
                if cu[j] - cu[j - 1] != d:
                    break
            else:
                return k, D, [d] * k
        counts = [None] * k
        d = 0
        for j in range(k):
            counts[j] = cu[j] - d
            d = cu[j]
        return k, D, counts
