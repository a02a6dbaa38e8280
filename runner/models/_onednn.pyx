# cython: language_level=3, boundscheck=False, wraparound=False
"""float32 CPU matmuls through oneDNN's C API, loaded at run time (C in a Cython module).

oneDNN's library is not linked at build time and its headers are not needed: :func:`load`
``dlopen``\\ s ``libdnnl.so.3`` (the ``onednn-cpu-gomp`` wheel's; ``runner/models/onednn.py``
finds the path) and ``dlsym``\\ s the C API functions used here into function pointers. The
few enum values and execution-argument ids are written below as constants, taken from
oneDNN 3.x's public C API (``dnnl_types.h`` / ``dnnl_common_types.h``); :func:`load` refuses a
library whose ``dnnl_version()`` is not major 3, where they hold.

:class:`Matmul` owns one weight ``[N, K]`` (torch's ``[out_features, in_features]``, row
major) reordered once into the blocked layout oneDNN's matmul picks for it, and computes
``dst[M, N] = src[M, K] @ weight.T (+ bias[N])`` for row-major float32 ``src`` / ``dst``.
Matmul primitives depend on the row count ``M`` and on the OpenMP thread count at their
creation (oneDNN sizes its work split by it). A :class:`Matmul` keeps one per ``M`` up to 64
(decode batches: the sizes a run meets step after step) and one for each of the last 8 larger
``M`` (prefill chunks). Making a primitive for an ``M`` never seen costs 0.1-0.3 ms (as torch's
op pays for a new shape); for one seen before and dropped here ~4 µs (oneDNN's own primitive
cache keeps the compiled kernel; measured, docs/performance.md, "Linears through oneDNN's C
API (issue 38, session 15)"). A primitive with a run-time ``M`` was measured and not taken: its
results are not bitwise those of a fixed-``M`` one (nor of torch's op) and it is up to 6 %
slower at decode sizes. A primitive is remade when the thread count or the bias-or-not of its
row count changes. Each has its scratchpad allocated once (user
scratchpad mode) and its memory objects re-pointed at the caller's buffers per call. Every
primitive runs on one CPU stream of one engine, created by :func:`load`.

oneDNN's OpenMP threads are torch's: the library NEEDs ``libgomp.so.1``, the SONAME of the
libgomp torch loads first, so the dynamic linker binds both to one runtime and
``torch.set_num_threads`` governs both (tests/runner/models/test_direct_onednn_linear_equals_torch_op.py
checks one libgomp in ``/proc/self/maps``).

The Python-facing wrapper is ``runner/models/cpu_linear.py`` (dtype, contiguity and shape
checks); :meth:`Matmul.run` takes raw addresses and trusts them.
"""

from libc.stdint cimport int64_t, uintptr_t

cdef extern from *:
    """
    #include <dlfcn.h>
    #include <stdint.h>
    #include <stddef.h>
    #include <stdio.h>
    #include <string.h>

    /* oneDNN 3.x C API values (dnnl_common_types.h, dnnl_types.h) */
    #define OD_SUCCESS 0
    #define OD_F32 3
    #define OD_TAG_ANY 1
    #define OD_TAG_AB 3
    #define OD_ENGINE_CPU 1
    #define OD_STREAM_DEFAULT 1
    #define OD_SCRATCHPAD_USER 1
    #define OD_QUERY_SRC_MD 129
    #define OD_QUERY_WEIGHTS_MD 131   /* index 1: the bias */
    #define OD_QUERY_DST_MD 133
    #define OD_QUERY_SCRATCHPAD_MD 136
    #define OD_ARG_SRC 1
    #define OD_ARG_DST 17
    #define OD_ARG_WEIGHTS 33
    #define OD_ARG_BIAS 41
    #define OD_ARG_SCRATCHPAD 80
    #define OD_ALLOCATE ((void *)(size_t)-1)   /* DNNL_MEMORY_ALLOCATE */
    #define OD_SMALL_M 64     /* row counts up to this: a primitive each (decode batches) */
    #define OD_RING 8         /* larger ones: the last 8 row counts */
    #define OD_MAX_NDIMS 12   /* DNNL_MAX_NDIMS: dnnl_dims_t is int64_t[12]; the rest zeroed */

    typedef struct { int arg; void *memory; } od_exec_arg;
    typedef struct { int major, minor, patch; const char *hash; unsigned cpu_runtime, gpu_runtime; } od_version_t;

    static struct {
        const od_version_t *(*version)(void);
        int (*engine_create)(void **, int, size_t);
        int (*stream_create)(void **, void *, unsigned);
        int (*md_with_strides)(void **, int, const int64_t *, int, const int64_t *);
        int (*md_with_tag)(void **, int, const int64_t *, int, int);
        int (*md_clone)(void **, const void *);
        int (*md_destroy)(void *);
        size_t (*md_size)(const void *);
        int (*attr_create)(void **);
        int (*attr_destroy)(void *);
        int (*attr_scratchpad_mode)(void *, int);
        int (*matmul_pd)(void **, void *, const void *, const void *, const void *, const void *, const void *);
        int (*reorder_pd)(void **, const void *, void *, const void *, void *, const void *);
        const void *(*pd_query_md)(const void *, int, int);
        int (*pd_destroy)(void *);
        int (*prim_create)(void **, const void *);
        int (*prim_destroy)(void *);
        int (*execute)(const void *, void *, int, const od_exec_arg *);
        int (*mem_create)(void **, const void *, void *, void *);
        int (*mem_destroy)(void *);
        int (*mem_set_handle)(void *, void *);
        int (*omp_max_threads)(void);
    } od;

    static void *od_lib = NULL;
    static void *od_engine = NULL;
    static void *od_stream = NULL;
    static int od_major = 0, od_minor = 0, od_patch = 0;

    /* dlopen + dlsym; 0 or -1 with a message in err */
    static int od_load(const char *path, char *err, size_t errlen) {
        if (od_lib) return 0;
        void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (!lib) { snprintf(err, errlen, "dlopen: %s", dlerror()); return -1; }
        #define OD_SYM(field, name) \
            *(void **)(&od.field) = dlsym(lib, name); \
            if (!od.field) { snprintf(err, errlen, "%s not found in %s", name, path); dlclose(lib); return -1; }
        OD_SYM(version, "dnnl_version")
        OD_SYM(engine_create, "dnnl_engine_create")
        OD_SYM(stream_create, "dnnl_stream_create")
        OD_SYM(md_with_strides, "dnnl_memory_desc_create_with_strides")
        OD_SYM(md_with_tag, "dnnl_memory_desc_create_with_tag")
        OD_SYM(md_clone, "dnnl_memory_desc_clone")
        OD_SYM(md_destroy, "dnnl_memory_desc_destroy")
        OD_SYM(md_size, "dnnl_memory_desc_get_size")
        OD_SYM(attr_create, "dnnl_primitive_attr_create")
        OD_SYM(attr_destroy, "dnnl_primitive_attr_destroy")
        OD_SYM(attr_scratchpad_mode, "dnnl_primitive_attr_set_scratchpad_mode")
        OD_SYM(matmul_pd, "dnnl_matmul_primitive_desc_create")
        OD_SYM(reorder_pd, "dnnl_reorder_primitive_desc_create")
        OD_SYM(pd_query_md, "dnnl_primitive_desc_query_md")
        OD_SYM(pd_destroy, "dnnl_primitive_desc_destroy")
        OD_SYM(prim_create, "dnnl_primitive_create")
        OD_SYM(prim_destroy, "dnnl_primitive_destroy")
        OD_SYM(execute, "dnnl_primitive_execute")
        OD_SYM(mem_create, "dnnl_memory_create")
        OD_SYM(mem_destroy, "dnnl_memory_destroy")
        OD_SYM(mem_set_handle, "dnnl_memory_set_data_handle")
        OD_SYM(omp_max_threads, "omp_get_max_threads")
        #undef OD_SYM
        const od_version_t *v = od.version();
        if (!v || v->major != 3) {
            snprintf(err, errlen, "%s is oneDNN %d.x; the constants here are oneDNN 3.x's", path, v ? v->major : -1);
            dlclose(lib); return -1;
        }
        if (od.engine_create(&od_engine, OD_ENGINE_CPU, 0) != OD_SUCCESS) {
            snprintf(err, errlen, "dnnl_engine_create(cpu) failed"); dlclose(lib); return -1;
        }
        if (od.stream_create(&od_stream, od_engine, OD_STREAM_DEFAULT) != OD_SUCCESS) {
            snprintf(err, errlen, "dnnl_stream_create failed"); dlclose(lib); return -1;
        }
        od_major = v->major; od_minor = v->minor; od_patch = v->patch;
        od_lib = lib;
        return 0;
    }

    /* one primitive for one (M, threads, bias) with its memory objects */
    typedef struct {
        int64_t m; int threads; int bias;
        void *prim, *src, *dst, *bmem, *scratch;
    } od_slot;

    typedef struct {
        int64_t n, k;
        void *wmd;        /* the packed weight's descriptor (owned) */
        void *wmem;       /* the packed weight (oneDNN-allocated) */
        od_slot small[OD_SMALL_M];   /* small[m - 1]: m rows */
        od_slot ring[OD_RING];       /* m > OD_SMALL_M */
        int next;                    /* the ring's round-robin victim */
    } od_matmul;

    static void od_slot_free(od_slot *s) {
        if (s->prim) od.prim_destroy(s->prim);
        if (s->src) od.mem_destroy(s->src);
        if (s->dst) od.mem_destroy(s->dst);
        if (s->bmem) od.mem_destroy(s->bmem);
        if (s->scratch) od.mem_destroy(s->scratch);
        memset(s, 0, sizeof(*s));
    }

    static void od_matmul_free(od_matmul *mm) {
        for (int i = 0; i < OD_SMALL_M; ++i) od_slot_free(&mm->small[i]);
        for (int i = 0; i < OD_RING; ++i) od_slot_free(&mm->ring[i]);
        if (mm->wmem) od.mem_destroy(mm->wmem);
        if (mm->wmd) od.md_destroy(mm->wmd);
        memset(mm, 0, sizeof(*mm));
    }

    /* descriptors of a row-major [rows, cols] f32 matrix, or of torch's [N, K] weight read as [K, N] */
    static int od_md_rows(void **md, int64_t rows, int64_t cols) {
        int64_t d[OD_MAX_NDIMS] = {rows, cols};
        return od.md_with_tag(md, 2, d, OD_F32, OD_TAG_AB);
    }
    static int od_md_weight_user(void **md, int64_t n, int64_t k) {
        int64_t d[OD_MAX_NDIMS] = {k, n}, s[OD_MAX_NDIMS] = {1, k};
        return od.md_with_strides(md, 2, d, OD_F32, s);
    }

    /* the matmul primitive descriptor for m rows; weights md given (or "any" when wmd is NULL) */
    static int od_matmul_pd(void **pd, int64_t m, int64_t n, int64_t k, const void *wmd, int bias) {
        void *src = NULL, *dst = NULL, *wany = NULL, *bmd = NULL, *attr = NULL;
        int st = od_md_rows(&src, m, k);
        if (st == OD_SUCCESS) st = od_md_rows(&dst, m, n);
        if (st == OD_SUCCESS && !wmd) {
            int64_t d[OD_MAX_NDIMS] = {k, n};
            st = od.md_with_tag(&wany, 2, d, OD_F32, OD_TAG_ANY);
        }
        if (st == OD_SUCCESS && bias) st = od_md_rows(&bmd, 1, n);
        if (st == OD_SUCCESS) st = od.attr_create(&attr);
        if (st == OD_SUCCESS) st = od.attr_scratchpad_mode(attr, OD_SCRATCHPAD_USER);
        if (st == OD_SUCCESS) st = od.matmul_pd(pd, od_engine, src, wmd ? wmd : wany, bmd, dst, attr);
        if (attr) od.attr_destroy(attr);
        if (src) od.md_destroy(src);
        if (dst) od.md_destroy(dst);
        if (wany) od.md_destroy(wany);
        if (bmd) od.md_destroy(bmd);
        return st;
    }

    /* pack torch's row-major [n, k] weight at w into oneDNN's layout for hint_m rows; status */
    static int od_matmul_init(od_matmul *mm, const float *w, int64_t n, int64_t k, int64_t hint_m) {
        memset(mm, 0, sizeof(*mm));
        mm->n = n; mm->k = k;
        void *pd = NULL, *rpd = NULL, *umd = NULL, *umem = NULL, *rprim = NULL;
        int st = od_matmul_pd(&pd, hint_m, n, k, NULL, 0);
        if (st == OD_SUCCESS) st = od.md_clone(&mm->wmd, od.pd_query_md(pd, OD_QUERY_WEIGHTS_MD, 0));
        if (st == OD_SUCCESS) st = od.mem_create(&mm->wmem, mm->wmd, od_engine, OD_ALLOCATE);
        if (st == OD_SUCCESS) st = od_md_weight_user(&umd, n, k);
        if (st == OD_SUCCESS) st = od.mem_create(&umem, umd, od_engine, (void *)w);
        if (st == OD_SUCCESS) st = od.reorder_pd(&rpd, umd, od_engine, mm->wmd, od_engine, NULL);
        if (st == OD_SUCCESS) st = od.prim_create(&rprim, rpd);
        if (st == OD_SUCCESS) {
            od_exec_arg args[2] = {{OD_ARG_SRC, umem}, {OD_ARG_DST, mm->wmem}};
            st = od.execute(rprim, od_stream, 2, args);
        }
        if (rprim) od.prim_destroy(rprim);
        if (rpd) od.pd_destroy(rpd);
        if (umem) od.mem_destroy(umem);
        if (umd) od.md_destroy(umd);
        if (pd) od.pd_destroy(pd);
        if (st != OD_SUCCESS) od_matmul_free(mm);
        return st;
    }

    /* (re)make slot s for m rows, the current thread count and bias; status */
    static int od_slot_make(od_matmul *mm, od_slot *s, int64_t m, int threads, int bias) {
        od_slot_free(s);
        void *pd = NULL;
        int st = od_matmul_pd(&pd, m, mm->n, mm->k, mm->wmd, bias);
        if (st == OD_SUCCESS) st = od.prim_create(&s->prim, pd);
        if (st == OD_SUCCESS) st = od.mem_create(&s->src, od.pd_query_md(pd, OD_QUERY_SRC_MD, 0), od_engine, NULL);
        if (st == OD_SUCCESS) st = od.mem_create(&s->dst, od.pd_query_md(pd, OD_QUERY_DST_MD, 0), od_engine, NULL);
        if (st == OD_SUCCESS && bias) st = od.mem_create(&s->bmem, od.pd_query_md(pd, OD_QUERY_WEIGHTS_MD, 1), od_engine, NULL);
        if (st == OD_SUCCESS) st = od.mem_create(&s->scratch, od.pd_query_md(pd, OD_QUERY_SCRATCHPAD_MD, 0),
                                                 od_engine, OD_ALLOCATE);
        if (pd) od.pd_destroy(pd);
        if (st != OD_SUCCESS) { od_slot_free(s); return st; }
        s->m = m; s->threads = threads; s->bias = bias;
        return OD_SUCCESS;
    }

    static inline int od_slot_fits(const od_slot *s, int64_t m, int threads, int bias) {
        return s->prim && s->m == m && s->threads == threads && s->bias == bias;
    }

    /* the slot serving m rows at the current thread count, made when missing: up to OD_SMALL_M
       rows one per row count, above a ring of the last OD_RING row counts; NULL + status when
       oneDNN refuses */
    static od_slot *od_matmul_slot(od_matmul *mm, int64_t m, int bias, int *status) {
        int threads = od.omp_max_threads();
        od_slot *s;
        *status = OD_SUCCESS;
        if (m <= OD_SMALL_M) {
            s = &mm->small[m - 1];
            if (!od_slot_fits(s, m, threads, bias)) *status = od_slot_make(mm, s, m, threads, bias);
            return *status == OD_SUCCESS ? s : NULL;
        }
        for (int i = 0; i < OD_RING; ++i)
            if (od_slot_fits(&mm->ring[i], m, threads, bias)) return &mm->ring[i];
        s = &mm->ring[mm->next];
        mm->next = (mm->next + 1) % OD_RING;
        *status = od_slot_make(mm, s, m, threads, bias);
        return *status == OD_SUCCESS ? s : NULL;
    }

    static int od_matmul_primitives(od_matmul *mm) {
        int n = 0;
        for (int i = 0; i < OD_SMALL_M; ++i) n += mm->small[i].prim != NULL;
        for (int i = 0; i < OD_RING; ++i) n += mm->ring[i].prim != NULL;
        return n;
    }

    /* the thread count of the primitive that serves m rows now (0: none yet) */
    static int od_matmul_threads_of(od_matmul *mm, int64_t m) {
        if (m >= 1 && m <= OD_SMALL_M) return mm->small[m - 1].prim ? mm->small[m - 1].threads : 0;
        for (int i = 0; i < OD_RING; ++i) if (mm->ring[i].prim && mm->ring[i].m == m) return mm->ring[i].threads;
        return 0;
    }

    static int od_threads(void) { return od_lib ? od.omp_max_threads() : 0; }

    static int od_matmul_run(od_slot *s, void *wmem, const float *x, float *out, const float *b) {
        od.mem_set_handle(s->src, (void *)x);
        od.mem_set_handle(s->dst, (void *)out);
        od_exec_arg args[5] = {{OD_ARG_SRC, s->src}, {OD_ARG_WEIGHTS, wmem}, {OD_ARG_DST, s->dst},
                               {OD_ARG_SCRATCHPAD, s->scratch}, {OD_ARG_BIAS, s->bmem}};
        if (b) od.mem_set_handle(s->bmem, (void *)b);
        return od.execute(s->prim, od_stream, b ? 5 : 4, args);
    }
    """
    ctypedef struct od_slot:
        int64_t m
    ctypedef struct od_matmul:
        int64_t n, k
        void *wmem
    int od_load(const char *path, char *err, size_t errlen)
    int od_major, od_minor, od_patch
    int od_matmul_init(od_matmul *mm, const float *w, int64_t n, int64_t k, int64_t hint_m)
    void od_matmul_free(od_matmul *mm)
    od_slot *od_matmul_slot(od_matmul *mm, int64_t m, int bias, int *status)
    int od_matmul_run(od_slot *s, void *wmem, const float *x, float *out, const float *b) nogil
    int od_matmul_primitives(od_matmul *mm)
    int od_matmul_threads_of(od_matmul *mm, int64_t m)
    int od_threads()


def load(str path):
    """Load oneDNN from ``path`` (once per process; later calls return at once) and create
    its CPU engine and stream.

    Returns:
        ``(major, minor, patch)`` of the loaded library.
    Raises:
        OSError: ``dlopen`` failed, a C API function is missing, the library is not oneDNN
            3.x, or the engine or stream could not be created (the message says which).
    """
    cdef char err[512]
    err[0] = 0
    if od_load(path.encode(), err, sizeof(err)) != 0:
        raise OSError(err.decode(errors="replace"))
    return (od_major, od_minor, od_patch)


def version():
    """``(major, minor, patch)`` of the loaded oneDNN, ``None`` before :func:`load`."""
    return (od_major, od_minor, od_patch) if od_major else None


def threads():
    """``omp_get_max_threads()`` of the OpenMP runtime oneDNN was bound to (the calling
    thread's), ``0`` before :func:`load`: with one runtime shared with torch, what
    ``torch.set_num_threads`` set."""
    return od_threads()


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
