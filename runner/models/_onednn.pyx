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

One file per concept: the library's loading here (the C API's constants, its function table,
the engine and stream; :func:`load`, :func:`version`, :func:`threads`); a :class:`Matmul`'s C
state, its primitives per row count and the product in ``_onednn_slots.pxi``; the
:class:`Matmul` class in ``_onednn_matmul.pxi`` (both included at the end).
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

    static int od_threads(void) { return od_lib ? od.omp_max_threads() : 0; }
    """
    int od_load(const char *path, char *err, size_t errlen)
    int od_major, od_minor, od_patch
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


include "_onednn_slots.pxi"
include "_onednn_matmul.pxi"
