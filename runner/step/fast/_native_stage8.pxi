# SampledRows: stage 8 (runner/step/append.py, spec_apply.py, placeholders.py), each call
# one checking pass then one writing pass: append_output_tokens' rows (one token each),
# append_verified_tokens' rows, append_placeholders' rows, fill_output_tokens' requests.
# A call either does all of its work or declines and writes nothing; the numpy code then
# runs and words the error — included by _native.pyx (shares its cimports)

from cpython.dict cimport PyDict_GetItem
from libc.stdlib cimport malloc, free


cdef class SampledRows:
    """The rows that sampled this step. Bound to the batch's ``[M, W]`` ``int32`` token
    table, its ``[M]`` ``int32`` columns ``num_tokens``, ``num_computed_tokens``,
    ``num_scheduled_tokens``, ``num_spec_tokens``, ``prev_sampled_index`` and
    ``prev_sampled_pos``, and its row → request id list (``InputBatch._req_ids``, ``None``
    in an empty row)."""

    cdef int32_t[:, ::1] tokens
    cdef int32_t[::1] num_tokens, ncc, sched, num_spec, prev_index, prev_pos
    cdef list req_ids
    cdef uint8_t[::1] seen  # scratch, all 0 between calls

    def __init__(self, tokens, num_tokens, ncc, sched, num_spec, prev_index, prev_pos, list req_ids):
        self.tokens, self.num_tokens, self.ncc, self.sched = tokens, num_tokens, ncc, sched
        self.num_spec, self.prev_index, self.prev_pos, self.req_ids = num_spec, prev_index, prev_pos, req_ids
        cdef Py_ssize_t M = self.num_tokens.shape[0]
        if (self.ncc.shape[0] != M or self.sched.shape[0] != M or self.prev_index.shape[0] != M
                or self.num_spec.shape[0] != M or self.prev_pos.shape[0] != M or self.tokens.shape[0] != M
                or len(req_ids) != M):
            raise ValueError("SampledRows: the columns differ in length")
        self.seen = np.zeros(M, np.uint8)

    cdef bint _check(self, const int64_t[:] rows, Py_ssize_t R, int64_t max_model_len, int64_t[::1] held,
                     bint drafts=False):
        """Whether every one of ``rows`` is in ``[0, R)``, distinct, holds a request, and
        samples this step (``num_computed_tokens + num_scheduled_tokens == num_tokens``,
        plus the row's ``num_spec_tokens`` with ``drafts``) below ``max_model_len`` and
        the table's width; each row's ``num_tokens`` into ``held`` (as far as the checks
        got)."""
        cdef Py_ssize_t i = 0, j, n = rows.shape[0], W = self.tokens.shape[1]
        cdef int64_t r, h
        cdef uint8_t* seen = &self.seen[0]
        if not (0 <= R <= self.seen.shape[0] and held.shape[0] == n and n <= R):
            return False
        while i < n:  # a row is marked seen only once it passed every check
            r = rows[i]
            if r < 0 or r >= R or seen[r] or self.req_ids[r] is None:
                break
            h = self.num_tokens[r]
            if (<int64_t>self.ncc[r] + self.sched[r] != h + (self.num_spec[r] if drafts else 0)
                    or h >= max_model_len or h >= W):
                break
            seen[r] = 1
            held[i] = h
            i += 1
        for j in range(i):  # the scratch back to 0
            seen[rows[j]] = 0
        return i == n

    def append_tokens(self, const int64_t[:] rows, Py_ssize_t R, int64_t max_model_len, int64_t[::1] held,
                      const int32_t[::1] tokens):
        """``append_output_tokens`` with one token a row: ``tokens[i]`` (checked ids) after
        row ``rows[i]``'s ``num_tokens`` tokens (``held[i]``), when the rows pass the
        checks of :meth:`append_placeholders`. Returns ``False``, nothing written, when
        one does not (or ``tokens`` is not ``[n]``)."""
        cdef Py_ssize_t i, n = rows.shape[0]
        cdef int64_t r, h
        if tokens.shape[0] != n or not self._check(rows, R, max_model_len, held):
            return False
        for i in range(n):
            r, h = rows[i], held[i]
            self.tokens[r, h] = tokens[i]
            self.num_tokens[r] = <int32_t>(h + 1)
        return True

    def append_verified(self, const int64_t[:] rows, Py_ssize_t R, int64_t max_model_len, int64_t[::1] held,
                        const int64_t[::1] lens, const int32_t[::1] flat):
        """``append_verified_tokens``: row ``rows[i]`` (which verified its
        ``num_spec_tokens`` drafts this step) emitted ``lens[i]`` tokens (``1 .. 1 +
        drafts``: the accepted drafts, then the corrected or bonus token), ``flat`` row
        after row (checked ids). With :meth:`append_placeholders`' checks (the drafts
        counted in the row's ``seq_len``) and at most ``max_model_len`` tokens a row, they
        go after the row's ``num_tokens`` tokens (over its drafts), which grows by
        ``lens[i]``, and its draft count goes to 0. Returns ``False``, nothing written,
        when a check fails."""
        cdef Py_ssize_t i, j, n = rows.shape[0], W = self.tokens.shape[1], off = 0
        cdef int64_t r, h, L, d
        cdef int64_t cap = max_model_len if max_model_len < W else W
        if lens.shape[0] != n or not self._check(rows, R, max_model_len, held, True):
            return False
        for i in range(n):
            L, d = lens[i], self.num_spec[rows[i]]
            if L < 1 or L > d + 1 or held[i] + L > cap:
                return False
            off += L
        if off != flat.shape[0]:
            return False
        off = 0
        for i in range(n):
            r, h, L = rows[i], held[i], lens[i]
            for j in range(L):
                self.tokens[r, h + j] = flat[off + j]
            off += L
            self.num_tokens[r] = <int32_t>(h + L)
            self.num_spec[r] = 0
        return True

    def append_placeholders(self, const int64_t[:] rows, Py_ssize_t R, int64_t max_model_len, int64_t[::1] held):
        """``append_placeholders``: row ``rows[i]`` (of ``0 .. R - 1``) samples entry ``i`` of
        this step's tensor. Checks that every row is in ``[0, R)``, distinct, holds a
        request, and samples this step (``num_computed_tokens + num_scheduled_tokens ==
        num_tokens``) below ``max_model_len`` and the table's width; then writes a
        placeholder (-1) at each row's ``num_tokens`` (into ``held[i]``), counts it, and
        points ``prev_sampled_index`` (-1 in the other rows of ``0 .. R - 1``) and
        ``prev_sampled_pos`` at it.

        Returns:
            The rows' request ids in order (a ``tuple``), or ``None``: a check failed and
            nothing was written (``held`` aside)."""
        cdef Py_ssize_t i, n = rows.shape[0]
        cdef int64_t r, h
        if not self._check(rows, R, max_model_len, held):
            return None
        names = tuple([self.req_ids[rows[i]] for i in range(n)])
        if R:
            memset(&self.prev_index[0], 0xFF, R * sizeof(int32_t))
        for i in range(n):
            r, h = rows[i], held[i]
            self.tokens[r, h] = -1
            self.num_tokens[r] = <int32_t>(h + 1)
            self.prev_index[r] = <int32_t>i
            self.prev_pos[r] = <int32_t>h
        return names

    def fill(self, tuple ids, const int64_t[::1] positions, object trusted_rows, dict index, dict requests,
             const int32_t[::1] toks):
        """``fill_output_tokens``: request ``ids[i]``'s placeholder at ``positions[i]`` takes
        ``toks[i]``. Its row is ``trusted_rows[i]`` (``[n]`` ``int64``, rows no request has
        left since), else ``index[ids[i]]``; a request in neither ``index`` nor
        ``requests`` finished and is skipped. Checks first that every other one is in a row
        holding a placeholder (-1) at its position.

        Returns:
            How many tokens were written, or -1: an id looked up that is not a ``str``, a
            request that left the batch but not the runner (``requests``), a row or position
            outside the table, or no placeholder there; nothing was written."""
        cdef Py_ssize_t i, n = len(ids), M = self.tokens.shape[0], W = self.tokens.shape[1], written = 0
        cdef int64_t r, p
        cdef const int64_t[::1] given
        cdef bint trusted = trusted_rows is not None
        cdef PyObject* o
        if positions.shape[0] != n or toks.shape[0] != n:
            return -1
        if trusted:
            given = trusted_rows
            if given.shape[0] != n:
                return -1
        cdef int64_t* found = <int64_t*>malloc(max(n, 1) * sizeof(int64_t))
        if found == NULL:
            raise MemoryError()
        try:
            for i in range(n):
                if trusted:
                    r = given[i]
                else:
                    if type(ids[i]) is not str:  # (a lookup that may fail to hash: the numpy code's)
                        return -1
                    o = PyDict_GetItem(index, ids[i])
                    if o == NULL:
                        if PyDict_GetItem(requests, ids[i]) != NULL:
                            return -1  # detached: the per-request loop writes its own history
                        found[i] = -1  # finished: skipped
                        continue
                    r = PyLong_AsSsize_t(<object>o)
                p = positions[i]
                if r < 0 or r >= M or p < 0 or p >= W or self.tokens[r, p] != -1:
                    return -1
                found[i] = r
            for i in range(n):
                r = found[i]
                if r >= 0:
                    self.tokens[r, positions[i]] = toks[i]
                    written += 1
            return written
        finally:
            free(found)
