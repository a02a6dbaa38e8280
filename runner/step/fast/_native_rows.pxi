# BlockRows: row operations on every cache group's block table — included by _native.pyx (shares its cimports and helpers)

cdef class BlockRows:
    """Row operations on every group of a ``MultiGroupBlockTable``, bound to its arrays.

    Args:
        num_blocks_per_row: ``[G, max_num_reqs]`` ``int32``.
        block_id_bound: ``[G, max_num_reqs]`` ``int32``: per row an upper bound of the ids it
            holds (``BlockTable.block_id_bound``), kept by every operation here.
        block_tables, kernel_tables: per group, the manager and kernel tables (the same
            array when ``k == 1``).
        kernel_blocks_per_block: per group, ``k``.
    """

    cdef int32_t[:, ::1] nblocks, idbound
    cdef list tables, ktables
    cdef int64_t[::1] kpb
    cdef bint _bound
    cdef int32_t[::1] _ncc, _sched, _flat, _no32
    cdef int64_t[::1] _rows, _ncts, _counts, _sel, _no64
    cdef int64_t[:, ::1] _start, _len

    def __init__(self, num_blocks_per_row, block_id_bound, list block_tables, list kernel_tables,
                 kernel_blocks_per_block):
        self.nblocks = num_blocks_per_row
        self.idbound = block_id_bound
        if self.idbound.shape[0] != self.nblocks.shape[0] or self.idbound.shape[1] != self.nblocks.shape[1]:
            raise ValueError("BlockRows: block_id_bound must have num_blocks_per_row's shape")
        self.tables, self.ktables = block_tables, kernel_tables
        self.kpb = np.asarray(kernel_blocks_per_block, dtype=np.int64)
        self._no32, self._no64 = np.zeros(0, np.int32), np.zeros(0, np.int64)
        self._bound = False

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
                n = min(self.nblocks[g, r], tab.shape[1])  # (a count is never wider; memory safety)
                for t in range(n):
                    tab[r, t] = NULL_BLOCK
                if k > 1:
                    for t in range(n * k):
                        ktab[r, t] = NULL_BLOCK
                self.nblocks[g, r] = 0
                self.idbound[g, r] = 0

    def move_rows(self, list srcs, list dsts):
        """Move the blocks of rows ``srcs`` into the vacant rows ``dsts`` (Python ints,
        pairwise; the two sets disjoint) in every group, then clear the sources.

        Raises:
            IndexError: a row outside the table, or lists of unequal length (nothing moved).
        """
        cdef Py_ssize_t g, i, s, d, n, t, M = self.nblocks.shape[1]
        cdef int64_t k
        cdef int32_t[:, ::1] tab, ktab
        if len(srcs) != len(dsts):
            raise IndexError(f"{len(srcs)} sources for {len(dsts)} targets")
        for i in range(len(srcs)):
            s, d = srcs[i], dsts[i]
            if s < 0 or s >= M or d < 0 or d >= M:
                raise IndexError(f"row {s} or {d} is outside the block table ({M} rows)")
        for g in range(self.nblocks.shape[0]):
            tab = self.tables[g]
            ktab = self.ktables[g]
            k = self.kpb[g]
            for i in range(len(srcs)):
                s, d = srcs[i], dsts[i]
                n = min(self.nblocks[g, s], tab.shape[1])
                for t in range(n):
                    tab[d, t] = tab[s, t]
                    tab[s, t] = NULL_BLOCK
                for t in range(n, min(self.nblocks[g, d], tab.shape[1])):
                    tab[d, t] = NULL_BLOCK
                if k > 1:
                    for t in range(n * k):
                        ktab[d, t] = ktab[s, t]
                        ktab[s, t] = NULL_BLOCK
                    for t in range(n * k, min(self.nblocks[g, d], tab.shape[1]) * k):
                        ktab[d, t] = NULL_BLOCK
                self.nblocks[g, d] = <int32_t>n
                self.nblocks[g, s] = 0
                self.idbound[g, d] = self.idbound[g, s]
                self.idbound[g, s] = 0

    def null_skipped(self, int32_t[::1] ncc, int32_t[::1] done, Py_ssize_t R, list windows, list block_sizes):
        """Stage 2's sliding-window nulling (``runner/step/apply_windows.py``) in one pass per
        window group: in group ``g`` (``windows[g]`` ``W`` tokens, ``None`` for any other
        group; manager block size ``block_sizes[g]`` ``B``), row ``r < R`` gets
        ``NULL_BLOCK_ID`` over its logical blocks ``skipped(done[r]) .. skipped(ncc[r]) - 1``
        (``skipped(n) = max(0, n - W + 1) // B``) in the manager table and their kernel
        expansion; ``block_id_bound`` is left (a null id raises no bound). Then
        ``done[:R] = ncc[:R]``.

        Returns:
            The number of manager entries written (all groups).

        Raises:
            IndexError: ``R`` past the columns or a block past a row of the table (checked
                before anything is written).
        """
        cdef Py_ssize_t g, r, col, q, G = self.nblocks.shape[0]
        cdef int64_t W, B, k, lo, hi, total = 0
        cdef int32_t[:, ::1] tab, ktab
        if R < 0 or R > ncc.shape[0] or R > done.shape[0] or R > self.nblocks.shape[1] \
                or len(windows) != G or len(block_sizes) != G:
            raise IndexError(f"BlockRows.null_skipped: {R} rows, {len(windows)} windows")
        for g in range(G):  # check every group before writing any
            if windows[g] is None:
                continue
            W, B = windows[g], block_sizes[g]
            if W < 1 or B < 1:
                raise IndexError(f"BlockRows.null_skipped: group {g}: window {W}, block size {B}")
            tab = self.tables[g]
            for r in range(R):
                if max(<int64_t>0, <int64_t>ncc[r] - (W - 1)) // B > tab.shape[1]:
                    raise IndexError(f"BlockRows.null_skipped: group {g}: row {r}'s skipped blocks "
                                     "leave the block table")
        for g in range(G):
            if windows[g] is None:
                continue
            W, B = windows[g], block_sizes[g]
            tab = self.tables[g]
            ktab = self.ktables[g]
            k = self.kpb[g]
            for r in range(R):
                hi = max(<int64_t>0, <int64_t>ncc[r] - (W - 1)) // B
                lo = max(<int64_t>0, <int64_t>done[r] - (W - 1)) // B
                if hi <= lo:
                    continue
                total += hi - lo
                for col in range(lo, hi):
                    tab[r, col] = NULL_BLOCK
                if k > 1:
                    for q in range(lo * k, hi * k):
                        ktab[r, q] = NULL_BLOCK
        for r in range(R):
            done[r] = ncc[r]
        return total

    def bind_scan(self, int32_t[::1] ncc, int32_t[::1] sched, rows, ncts, counts, app_sel, app_start, app_len,
                  app_flat):
        """Bind :meth:`merge_scan` to the batch's ``num_computed_tokens`` / ``num_scheduled_tokens``
        columns and to the plan buffers a ``CachedScan`` writes (``plan.ScanBuffers``)."""
        self._ncc, self._sched = ncc, sched
        self._rows, self._ncts, self._counts, self._sel = rows, ncts, counts, app_sel
        self._start, self._len, self._flat = app_start, app_len, app_flat
        self._bound = True

    def merge_scan(self, Py_ssize_t n, Py_ssize_t m, bint one_each):
        """:meth:`merge` of a plan whose arrays are the bound plan buffers' prefixes: ``n``
        cached requests, ``m`` appending ones (no per-call buffer acquisition).

        Raises:
            IndexError: as :meth:`merge`; or nothing bound, or ``n`` / ``m`` past the buffers.
        """
        if not self._bound or n < 0 or m < 0 or n > self._rows.shape[0] or m > self._sel.shape[0] \
                or m > self._start.shape[1]:
            raise IndexError("merge_scan: no plan buffers bound, or counts past them")
        self._merge(self._ncc, self._sched, self._rows[:n], self._ncts[:n], self._counts[:n], self._sel[:m],
                    self._start, self._len, one_each, self._flat, self._no64, False)

    def merge(self, int32_t[::1] ncc, int32_t[::1] sched, const int64_t[:] rows_c, const int64_t[:] ncts_c,
              const int64_t[:] counts_c, const int64_t[:] sel, const int64_t[:, :] starts, lens,
              flat, bint one_each):
        """Merge checked cached-request deltas (``UpdatePlan``'s arrays) into the rows:
        ``num_computed_tokens`` and ``num_scheduled_tokens`` of rows ``rows_c``, then the
        appended ids (``flat``, group-major then ``sel`` order; ``lens`` ``[G, m]``, or 1
        each when ``one_each``) after ``starts`` in every group, with their kernel expansion.

        Raises:
            IndexError: a row, column or id count outside the tables (nothing is written
                after the first; stage 1 excludes it).
        """
        cdef const int64_t[:, :] lv = starts
        if not one_each:
            lv = lens
        if flat.dtype == np.int64:
            self._merge(ncc, sched, rows_c, ncts_c, counts_c, sel, starts, lv, one_each, self._no32, flat, True)
        else:
            self._merge(ncc, sched, rows_c, ncts_c, counts_c, sel, starts, lv, one_each, flat, self._no64, False)

    cdef int _merge(self, int32_t[::1] ncc, int32_t[::1] sched, const int64_t[:] rows_c, const int64_t[:] ncts_c,
                    const int64_t[:] counts_c, const int64_t[:] sel, const int64_t[:, :] starts,
                    const int64_t[:, :] lv, bint one_each, const int32_t[:] f32, const int64_t[:] f64,
                    bint wide) except -1:
        """The body of :meth:`merge` (``lv`` unread when ``one_each``; ids from ``f64`` when
        ``wide``, else ``f32``)."""
        cdef Py_ssize_t i, j, g, t, off = 0, r, col, q, n, M = self.nblocks.shape[1], m = sel.shape[0]
        cdef Py_ssize_t G = self.nblocks.shape[0]
        cdef int64_t k, b, L, hi
        cdef int32_t[:, ::1] tab, ktab
        if rows_c.shape[0] != ncts_c.shape[0] or rows_c.shape[0] != counts_c.shape[0]:
            raise IndexError("merge: rows, num_computed_tokens and counts differ in length")
        for i in range(rows_c.shape[0]):
            r = rows_c[i]
            if r < 0 or r >= M:
                raise IndexError(f"merge: row {r} is outside the batch ({M} rows)")
            ncc[r] = <int32_t>ncts_c[i]
            sched[r] = <int32_t>counts_c[i]
        if m == 0:
            return 0
        n = f64.shape[0] if wide else f32.shape[0]
        for g in range(G):
            tab = self.tables[g]
            ktab = self.ktables[g]
            k = self.kpb[g]
            for j in range(m):
                if sel[j] < 0 or sel[j] >= rows_c.shape[0]:
                    raise IndexError("merge: an append selects no cached request")
                r = rows_c[sel[j]]
                col = starts[g, j]
                L = 1 if one_each else lv[g, j]
                if col < 0 or col + L > tab.shape[1] or off + L > n:
                    raise IndexError("merge: an append leaves the block table or the ids")
                hi = self.idbound[g, r]
                for t in range(L):
                    b = f64[off + t] if wide else f32[off + t]
                    tab[r, col + t] = <int32_t>b
                    if b > hi:
                        hi = b
                    if k > 1:
                        for q in range(k):
                            ktab[r, (col + t) * k + q] = <int32_t>(b * k + q)
                off += L
                self.nblocks[g, r] = <int32_t>(col + L)
                self.idbound[g, r] = <int32_t>hi
        return 0
