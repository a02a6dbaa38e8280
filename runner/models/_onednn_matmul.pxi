# Included by _onednn.pyx after _onednn_slots.pxi (shares its cimports): the Python-facing Matmul
# over its C state.


cdef class Matmul:
    """One float32 weight ``[N, K]`` packed for oneDNN's matmul, and its primitives.

    Args:
        weight_ptr: address of a contiguous row-major float32 ``[N, K]`` (torch's
            ``[out_features, in_features]``); read once here (the packed copy is owned by
            this object, freed with it).
        n, k: ``N`` (output features) and ``K`` (input features), ``>= 1``.
        hint_m: the row count the weight's layout is chosen for (any row count runs).
    Raises:
        RuntimeError: :func:`load` has not succeeded, or oneDNN refused (its status code).
    """
    cdef od_matmul mm
    cdef bint ready
    cdef bint busy

    def __cinit__(self, uintptr_t weight_ptr, int64_t n, int64_t k, int64_t hint_m=16):
        self.ready = False
        self.busy = False
        if not od_major:
            raise RuntimeError("oneDNN is not loaded (attnplug.runner.models._onednn.load)")
        if n < 1 or k < 1 or hint_m < 1:
            raise ValueError(f"Matmul: n={n}, k={k}, hint_m={hint_m} must be >= 1")
        cdef int st = od_matmul_init(&self.mm, <const float *>weight_ptr, n, k, hint_m)
        if st != 0:
            raise RuntimeError(f"oneDNN refused the weight reorder ({n} x {k}, float32): status {st}")
        self.ready = True

    def __dealloc__(self):
        if self.ready:
            od_matmul_free(&self.mm)

    @property
    def n(self):
        return self.mm.n

    @property
    def k(self):
        return self.mm.k

    @property
    def primitives(self):
        """How many matmul primitives are held: one per row count up to 64 seen (for the
        thread count and bias of its last call) and one for each of the last 8 larger row
        counts."""
        return od_matmul_primitives(&self.mm)

    def threads_of(self, int64_t m):
        """The OpenMP thread count the primitive serving ``m`` rows was made for (0: none yet)."""
        return od_matmul_threads_of(&self.mm, m)

    def run(self, uintptr_t x_ptr, int64_t m, uintptr_t out_ptr, uintptr_t bias_ptr=0):
        """``out[m, N] = x[m, K] @ weight.T (+ bias[N])``, row-major float32 at the given
        addresses (``bias_ptr`` 0: none). Runs without the GIL.

        Returns:
            ``True``; ``False`` when this object is already running in another thread (the
            caller computes the product another way: one object's memory objects are not
            shared between concurrent calls).
        Raises:
            ValueError: ``m < 1``.
            RuntimeError: oneDNN refused to create or run the primitive (its status code).
        """
        cdef int st = 0
        cdef od_slot *s
        if m < 1:
            raise ValueError(f"Matmul.run: m={m} must be >= 1")
        if self.busy:
            return False
        s = od_matmul_slot(&self.mm, m, bias_ptr != 0, &st)
        if s == NULL:
            raise RuntimeError(f"oneDNN refused the matmul primitive ({m} x {self.mm.k} x {self.mm.n}, "
                               f"float32): status {st}")
        self.busy = True
        with nogil:
            st = od_matmul_run(s, self.mm.wmem, <const float *>x_ptr, <float *>out_ptr, <const float *>bias_ptr)
        self.busy = False
        if st != 0:
            raise RuntimeError(f"dnnl_primitive_execute failed: status {st}")
        return True
