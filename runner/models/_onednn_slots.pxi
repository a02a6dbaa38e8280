# Included by _onednn.pyx (its C, in order, after the loader's: the od function table, engine and
# stream): a Matmul's state in C: the packed weight, its primitives per row count (slots) with
# their memory objects, and the product on one slot (shares _onednn.pyx's cimports).

cdef extern from *:
    """
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
    int od_matmul_init(od_matmul *mm, const float *w, int64_t n, int64_t k, int64_t hint_m)
    void od_matmul_free(od_matmul *mm)
    od_slot *od_matmul_slot(od_matmul *mm, int64_t m, int bias, int *status)
    int od_matmul_run(od_slot *s, void *wmem, const float *x, float *out, const float *b) nogil
    int od_matmul_primitives(od_matmul *mm)
    int od_matmul_threads_of(od_matmul *mm, int64_t m)
