# Prepare's per-row loops over equal or mixed row widths, as inline functions: each caller
# passes the usual widths (2-5) as literals, so the compiler unrolls them; and the test for
# the usual asynchronous patch. None raises (a function that raises is not inlined) —
# included by _native.pyx (shares its cimports)

cdef inline Py_ssize_t _slot_rows(Py_ssize_t R, Py_ssize_t w, const int32_t* qsl, const int64_t* positions,
                                  const int32_t* tb, Py_ssize_t ncols, int64_t sh, int64_t* slots) noexcept:
    """``Prepare._row_slots``' loop; ``w > 0``: every row holds ``w`` tokens (row ``r``'s are
    ``[r w, (r + 1) w)``, ``qsl`` unread), a constant at each call; ``0``: from ``qsl``.
    Returns -1, or the first row whose last position lies past the block table (the rows
    before it written). No raise here: the function stays small enough to be inlined."""
    cdef Py_ssize_t r, t, s, e
    cdef int64_t c, col0, col1, base, mask = (<int64_t>1 << sh) - 1, pos
    cdef const int32_t* rowp
    for r in range(R):
        if w > 0:
            s = r * w
            e = s + w
        else:
            s = qsl[r]
            e = qsl[r + 1]
            if s >= e:
                continue
        c = positions[s]
        col1 = (c + e - s - 1) >> sh
        if col1 >= ncols:
            return r
        rowp = tb + r * ncols
        col0 = c >> sh
        if col0 == col1:  # (the slot of position c + j is base + s + j)
            base = ((<int64_t>rowp[col0] - col0) << sh) + c - s
            for t in range(s, e):
                slots[t] = base + t
        else:
            for t in range(s, e):
                pos = c + t - s
                slots[t] = (<int64_t>rowp[pos >> sh] << sh) + (pos & mask)
    return -1


cdef inline int32_t _copy_rows(Py_ssize_t R, Py_ssize_t w, const int32_t* qsl, const int32_t* ncc,
                               const int32_t* tok, Py_ssize_t width, int32_t* ids) noexcept:
    """``Prepare._gather_rows``' loop: row ``r``'s tokens are ``tok[r, ncc[r] : ncc[r] + q]``
    (``_rows`` checked that they lie in the table), at ``ids[qsl[r]:]``; ``w > 0``: ``q = w``
    and row ``r`` starts at ``r w`` (a constant at each call); ``0``: from ``qsl``. Returns
    the OR of the tokens."""
    cdef Py_ssize_t r, j, s, q
    cdef int32_t v, neg = 0
    cdef const int32_t* src
    for r in range(R):
        if w > 0:
            s = r * w
            q = w
        else:
            s = qsl[r]
            q = qsl[r + 1] - s
        src = tok + r * width + ncc[r]
        for j in range(q):
            v = src[j]
            ids[s + j] = v
            neg |= v
    return neg


cdef inline bint _rows_in_order(Py_ssize_t R, const int32_t* pidx, const int32_t* ppos, const int32_t* ncc,
                                const int32_t* qsl) noexcept:
    """The asynchronous patch of the usual step (``R >= 1`` rows, each sampled last step in
    batch order, its placeholder the first of its tokens this step: a decode step whose
    rows kept their order): row ``r``'s ``prev_sampled_index`` is ``r``, its placeholder's
    position its ``num_computed_tokens`` and its first token ``r`` (``query_start_loc[r]
    == r``), and the last row holds a token (``query_start_loc[R] >= R``; the others hold
    one each). The patch is then ``arange(R)``, as ``Prepare._plan_patch``'s row loop
    would find it. One branch-free pass (vectorised): the OR of the differences."""
    cdef Py_ssize_t r
    cdef int32_t acc = 0
    for r in range(R):
        acc |= (pidx[r] ^ <int32_t>r) | (ppos[r] - ncc[r]) | (qsl[r] ^ <int32_t>r)
    return acc == 0 and qsl[R] >= R
