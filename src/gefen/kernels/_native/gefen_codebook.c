/*
 * The exact 1-D optimal k-means of the codebook fit (algorithm.md section 4.3, section 13.2), natively.
 * Included by gefen_kernels.c (one shared library, one translation unit).
 *
 * The programme and its arithmetic are those of gefen.math.codebook.optimal_partition_centers, operation for
 * operation in float64 (the file is compiled with -ffp-contract=off, so no multiply-add is fused): prefix sums
 * W, X, Q (computed by the caller); a free cluster over points s..e costs q - x*x/w with w = W[e] - W[s-1], etc.;
 * the first cluster is pinned to -1 (q + 2x + w) and the last to +1 (q - 2x + w) when force_endpoints is set;
 * F[c][e] = min over s of F[c-1][s-1] + cost(s, e), first minimum on ties; backtrack from (A, k).
 *
 * Each layer's row minima come from divide and conquer on the monotone arg-min with tolerance windows: the
 * caller's rounding slack (c0, c1) bounds how far the computed candidates can stray from a Monge array, and with
 * tol = 8 (c0 + c1 max|F[c-1]|) every candidate outside [L of the nearest solved row above, R of the nearest solved
 * row below] is provably worse than the row's minimum (see gefen.math.codebook._Layer). So the minima and the
 * first arg-minima equal the plain O(k A^2) scan's, near-ties included, in O(k A log A) evaluations. The recursion
 * is taken breadth first (the rows of one depth are independent, so their solves overlap in the CPU), and with
 * AVX-512 a row's candidates are evaluated eight at a time (a window of at most 8 in one register).
 */

typedef struct {
    const double *W, *X, *Q; /* prefix sums, (A + 1,) each */
    const double *F_prev;    /* (rows,) */
    double *F;               /* (rows,) this layer */
    int32_t *L, *R, *arg;    /* (rows,) window ends and first arg-min */
    double *scratch;         /* (2, rows + 8) candidate values of one row, one buffer per half of a layer */
    int64_t c;               /* cluster index (1-based), 2 <= c <= k - 1 */
    int64_t rows;
    int avx2, avx512;        /* the CPU has AVX2, AVX-512 */
    double tol;
    int32_t *segs;           /* (2, 8 (rows + 2)): each half's segment lists (see dp_rows) */
} dp_layer;

#if GEFEN_X86
/* F[i] + (q - x * x / w) for four candidates: w = We - W[i] etc. (dp_row's operations; the AVX2 rows, dp_row_short
 * and dp_row_wide, take every window on such CPUs, so dp_row itself only decides a NaN or an empty window). */
__attribute__((target("avx2"))) static inline __m256d dp_cost4(__m256d we, __m256d xe, __m256d qe, const double *W,
                                                               const double *X, const double *Q, const double *F) {
    const __m256d w = _mm256_sub_pd(we, _mm256_loadu_pd(W)), x = _mm256_sub_pd(xe, _mm256_loadu_pd(X));
    const __m256d q = _mm256_sub_pd(qe, _mm256_loadu_pd(Q));
    return _mm256_add_pd(_mm256_loadu_pd(F), _mm256_sub_pd(q, _mm256_div_pd(_mm256_mul_pd(x, x), w)));
}
#endif

/* Row j of a layer: minimum of F_prev[i] + cost(c + i, c + j) over lo <= i <= hi, its first arg-min and the
 * first / last i within tol of it. */
static void dp_row(const dp_layer *ly, int64_t j, int64_t lo, int64_t hi, double *scratch) {
    const int64_t e = ly->c + j;
    const double We = ly->W[e], Xe = ly->X[e], Qe = ly->Q[e];
    const double *W = ly->W + ly->c - 1, *X = ly->X + ly->c - 1, *Q = ly->Q + ly->c - 1, *F = ly->F_prev;
    double *v = scratch + lo;
    for (int64_t i = lo; i <= hi; i++) {
        const double w = We - W[i], x = Xe - X[i], q = Qe - Q[i];
        v[i - lo] = F[i] + (q - x * x / w);
    }
    double m = INFINITY;
    int64_t best = lo;
    for (int64_t i = lo; i <= hi; i++)
        if (v[i - lo] < m) m = v[i - lo], best = i;
    const double limit = m + ly->tol;
    int64_t first = lo;
    while (first <= hi && !(v[first - lo] <= limit)) first++;
    int64_t last = hi;
    while (last >= lo && !(v[last - lo] <= limit)) last--;
    ly->F[j] = m;
    ly->arg[j] = (int32_t)best;
    ly->L[j] = (int32_t)first;
    ly->R[j] = (int32_t)last;
}

#if GEFEN_X86
#define T512D __attribute__((target("avx512f,avx512dq")))
/* The candidates lo + 8t .. lo + 8t + 7 of row j (lanes past hi: +inf), with the same operations as dp_row. */
T512D static inline __m512d dp_values8(const dp_layer *ly, int64_t e, int64_t i, __mmask8 valid) {
    const int64_t base = ly->c - 1 + i; /* masked lanes read nothing, and see w = W[e] > 0 */
    const __m512d w = _mm512_sub_pd(_mm512_set1_pd(ly->W[e]), _mm512_maskz_loadu_pd(valid, ly->W + base));
    const __m512d x = _mm512_sub_pd(_mm512_set1_pd(ly->X[e]), _mm512_maskz_loadu_pd(valid, ly->X + base));
    const __m512d q = _mm512_sub_pd(_mm512_set1_pd(ly->Q[e]), _mm512_maskz_loadu_pd(valid, ly->Q + base));
    const __m512d cost = _mm512_sub_pd(q, _mm512_div_pd(_mm512_mul_pd(x, x), w));
    return _mm512_mask_blend_pd(valid, _mm512_set1_pd(INFINITY),
                                _mm512_add_pd(_mm512_maskz_loadu_pd(valid, ly->F_prev + i), cost));
}

static inline __mmask8 lanes_upto(int64_t n) { return (__mmask8)(n >= 8 ? 0xFFu : (1u << n) - 1u); }

/* dp_row with 8 candidates per vector: the same values, minimum (the first minimal candidate's value), first
 * arg-min and tolerance window. A window of at most 8 stays in one register. */
T512D static void dp_row512(const dp_layer *ly, int64_t j, int64_t lo, int64_t hi, double *scratch) {
    const int64_t e = ly->c + j, n = hi - lo + 1;
    int64_t best, first, last;
    double m;
    if (n <= 0) { /* an empty window (only after a NaN, see below): the scalar rule */
        dp_row(ly, j, lo, hi, scratch);
        return;
    }
    if (n <= 8) {
        const __mmask8 valid = lanes_upto(n);
        const __m512d v = dp_values8(ly, e, lo, valid);
        if (_mm512_cmp_pd_mask(v, v, _CMP_UNORD_Q)) { /* a NaN (prefix sums overflowed): the scalar rule */
            dp_row(ly, j, lo, hi, scratch);
            return;
        }
        /* The minimum in every lane by register shuffles (this chain is the row's latency: 17.2 -> 16.1 ms for a
         * full k = 255 fit on one Zen 4 core, against a reduction to a scalar and a store/reload of the first
         * minimal lane), its first lane, and the window's limit from it: the first minimal value can differ from
         * that minimum only in the sign of a zero, which neither m + tol (tol >= 0) nor the comparisons see; F
         * keeps the first minimal value itself. */
        __m512d low = _mm512_min_pd(v, _mm512_shuffle_f64x2(v, v, 0x4E));
        low = _mm512_min_pd(low, _mm512_shuffle_f64x2(low, low, 0xB1));
        low = _mm512_min_pd(low, _mm512_permute_pd(low, 0x55));
        const unsigned at = (unsigned)__builtin_ctz((unsigned)_mm512_cmp_pd_mask(v, low, _CMP_EQ_OQ));
        const __m512d limit = _mm512_add_pd(low, _mm512_set1_pd(ly->tol));
        const unsigned near = (unsigned)_mm512_cmp_pd_mask(v, limit, _CMP_LE_OQ) & (unsigned)valid;
        m = _mm512_cvtsd_f64(_mm512_permutexvar_pd(_mm512_set1_epi64(at), v));
        best = lo + at;
        first = lo + __builtin_ctz(near);
        last = lo + 31 - __builtin_clz(near);
    } else {
        const int64_t chunks = (n + 7) / 8;
        __m512d low = _mm512_set1_pd(INFINITY);
        __mmask8 nan = 0;
        for (int64_t t = 0; t < chunks; t++) {
            const __m512d v = dp_values8(ly, e, lo + 8 * t, lanes_upto(n - 8 * t));
            _mm512_storeu_pd(scratch + 8 * t, v); /* scratch: 8 * chunks doubles, +inf past the window */
            low = _mm512_min_pd(low, v);
            nan |= _mm512_cmp_pd_mask(v, v, _CMP_UNORD_Q);
        }
        if (nan) { /* a NaN (prefix sums overflowed): the scalar rule */
            dp_row(ly, j, lo, hi, scratch);
            return;
        }
        const __m512d vm = _mm512_set1_pd(_mm512_reduce_min_pd(low));
        int64_t t = 0;
        unsigned hit = 0;
        for (; t < chunks; t++)
            if ((hit = (unsigned)_mm512_cmp_pd_mask(_mm512_loadu_pd(scratch + 8 * t), vm, _CMP_EQ_OQ))) break;
        best = lo + 8 * t + __builtin_ctz(hit);
        m = scratch[best - lo];
        const __m512d limit = _mm512_set1_pd(m + ly->tol);
        for (t = 0; t < chunks; t++) /* the minimum's own chunk at the latest */
            if ((hit = (unsigned)_mm512_cmp_pd_mask(_mm512_loadu_pd(scratch + 8 * t), limit, _CMP_LE_OQ))) break;
        first = lo + 8 * t + __builtin_ctz(hit);
        for (t = chunks - 1; t >= 0; t--) /* the lanes past the window never count (even if the limit is +inf) */
            if ((hit = (unsigned)_mm512_mask_cmp_pd_mask(lanes_upto(n - 8 * t), _mm512_loadu_pd(scratch + 8 * t),
                                                         limit, _CMP_LE_OQ)))
                break;
        last = lo + 8 * t + 31 - __builtin_clz(hit);
    }
    ly->F[j] = m;
    ly->arg[j] = (int32_t)best;
    ly->L[j] = (int32_t)first;
    ly->R[j] = (int32_t)last;
}
#endif

#if GEFEN_X86
#define T256D __attribute__((target("avx2")))
/* Candidates lo .. lo + 3 of row j (e = c + j) with dp_row's operations; lanes at or past n: +inf. Plain loads: W,
 * X, Q and F_prev have 8 readable doubles past their ends (see gefen_kmeans_centres); what they hold is blended
 * out. */
T256D static inline __m256d dp_values4(const dp_layer *ly, int64_t e, int64_t lo, int64_t n) {
    const int64_t base = ly->c - 1 + lo;
    const __m256i valid = _mm256_cmpgt_epi64(_mm256_set1_epi64x(n), _mm256_setr_epi64x(0, 1, 2, 3));
    const __m256d v = dp_cost4(_mm256_set1_pd(ly->W[e]), _mm256_set1_pd(ly->X[e]), _mm256_set1_pd(ly->Q[e]),
                               ly->W + base, ly->X + base, ly->Q + base, ly->F_prev + lo);
    return _mm256_blendv_pd(_mm256_set1_pd(INFINITY), v, _mm256_castsi256_pd(valid));
}

/* dp_row for a window of n candidates, 1 <= n <= 4 (two = 0, one vector) or 5 <= n <= 8 (two = 1), without a loop
 * or a branch on the values: dp_row's loops mispredict their exits on the short windows that most rows have (2-5
 * candidates for k = 255, A = 4096). The same values, minimum (the first minimal candidate's value), first arg-min
 * and tolerance window. Zen 1, that fit on two threads: 28.5 -> 25.4 ms. Returns 0 (nothing written) when the
 * scalar rule must decide: a NaN, or no candidate within the limit (a NaN limit). */
T256D static inline __attribute__((always_inline)) int dp_row_short(const dp_layer *ly, int64_t j, int64_t lo,
                                                                    int64_t n, const int two) {
    const int64_t e = ly->c + j;
    const __m256d v0 = dp_values4(ly, e, lo, n);
    const __m256d v1 = two ? dp_values4(ly, e, lo + 4, n - 4) : v0;
    __m256d low = two ? _mm256_min_pd(v0, v1) : v0;
    low = _mm256_min_pd(low, _mm256_permute2f128_pd(low, low, 1));
    low = _mm256_min_pd(low, _mm256_permute_pd(low, 5));
    const __m256d limit = _mm256_add_pd(low, _mm256_set1_pd(ly->tol));
    const unsigned nan = (unsigned)_mm256_movemask_pd(_mm256_cmp_pd(v0, v1, _CMP_UNORD_Q));
    unsigned eq = (unsigned)_mm256_movemask_pd(_mm256_cmp_pd(v0, low, _CMP_EQ_OQ));
    unsigned near = (unsigned)_mm256_movemask_pd(_mm256_cmp_pd(v0, limit, _CMP_LE_OQ));
    if (two) {
        eq |= (unsigned)_mm256_movemask_pd(_mm256_cmp_pd(v1, low, _CMP_EQ_OQ)) << 4;
        near |= (unsigned)_mm256_movemask_pd(_mm256_cmp_pd(v1, limit, _CMP_LE_OQ)) << 4;
    }
    near &= (1u << n) - 1u; /* a +inf limit takes in the +inf lanes past the window */
    if (nan | !near) return 0;
    double vals[8];
    _mm256_storeu_pd(vals, v0);
    if (two) _mm256_storeu_pd(vals + 4, v1);
    const unsigned at = (unsigned)__builtin_ctz(eq);
    ly->F[j] = vals[at];
    ly->arg[j] = (int32_t)(lo + at);
    ly->L[j] = (int32_t)(lo + __builtin_ctz(near));
    ly->R[j] = (int32_t)(lo + 31 - __builtin_clz(near));
    return 1;
}

/* dp_row_short for 1 <= n <= 8, specialised on n <= 4. */
T256D static int dp_row_upto8(const dp_layer *ly, int64_t j, int64_t lo, int64_t n) {
    return n <= 4 ? dp_row_short(ly, j, lo, n, 0) : dp_row_short(ly, j, lo, n, 1);
}

/* dp_row for a window of n >= 1 candidates with its three scans four lanes at a time (dp_row512's wide case on
 * AVX2): the values into scratch (+inf past the window, to a multiple of 4), their minimum, the first candidate
 * equal to it (its own value, as dp_row keeps the first minimal one), the first and the last within the limit.
 * dp_row, whose scans are scalar, took 27 % of a k = 255 fit on Zen 1 (one thread; its vector values another
 * 19 %): the rows of the top depths have windows of 100s to 1000s of candidates. Returns 0 (nothing written) when
 * the scalar rule must decide: a NaN, or no candidate within the limit (a NaN limit). */
T256D static int dp_row_wide(const dp_layer *ly, int64_t j, int64_t lo, int64_t n, double *scratch) {
    const int64_t e = ly->c + j, chunks = (n + 3) / 4, base = ly->c - 1 + lo;
    const __m256d we = _mm256_set1_pd(ly->W[e]), xe = _mm256_set1_pd(ly->X[e]), qe = _mm256_set1_pd(ly->Q[e]);
    __m256d low = _mm256_set1_pd(INFINITY), nan = _mm256_setzero_pd();
    for (int64_t t = 0; t < chunks; t++) {
        const int64_t i = 4 * t;
        const __m256d v = i + 4 <= n ? dp_cost4(we, xe, qe, ly->W + base + i, ly->X + base + i, ly->Q + base + i,
                                                ly->F_prev + lo + i)
                                     : dp_values4(ly, e, lo + i, n - i);
        _mm256_storeu_pd(scratch + i, v);
        low = _mm256_min_pd(low, v);
        nan = _mm256_or_pd(nan, _mm256_cmp_pd(v, v, _CMP_UNORD_Q));
    }
    if (_mm256_movemask_pd(nan)) return 0;
    low = _mm256_min_pd(low, _mm256_permute2f128_pd(low, low, 1));
    low = _mm256_min_pd(low, _mm256_permute_pd(low, 5));
    int64_t t = 0;
    unsigned hit = 0;
    for (; t < chunks; t++) /* found: low is one of the values */
        if ((hit = (unsigned)_mm256_movemask_pd(_mm256_cmp_pd(_mm256_loadu_pd(scratch + 4 * t), low, _CMP_EQ_OQ))))
            break;
    const int64_t best = 4 * t + __builtin_ctz(hit);
    const double m = scratch[best];
    const __m256d limit = _mm256_set1_pd(m + ly->tol);
    for (t = 0; t < chunks; t++) /* the minimum's own chunk at the latest, unless the limit is a NaN */
        if ((hit = (unsigned)_mm256_movemask_pd(_mm256_cmp_pd(_mm256_loadu_pd(scratch + 4 * t), limit, _CMP_LE_OQ))))
            break;
    if (!hit) return 0;
    const int64_t first = 4 * t + __builtin_ctz(hit);
    for (t = chunks - 1;; t--) { /* the lanes past the window never count (even if the limit is +inf) */
        const unsigned valid = n - 4 * t >= 4 ? 15u : (1u << (n - 4 * t)) - 1u;
        hit = valid & (unsigned)_mm256_movemask_pd(_mm256_cmp_pd(_mm256_loadu_pd(scratch + 4 * t), limit, _CMP_LE_OQ));
        if (hit) break;
    }
    ly->F[j] = m;
    ly->arg[j] = (int32_t)(lo + best);
    ly->L[j] = (int32_t)(lo + first);
    ly->R[j] = (int32_t)(lo + 4 * t + 31 - __builtin_clz(hit));
    return 1;
}
#endif

/* dp_row in whichever form fits the window. */
static void dp_solve(const dp_layer *ly, int64_t j, int64_t lo, int64_t hi, double *scratch) {
#if GEFEN_X86
    if (ly->avx512) {
        dp_row512(ly, j, lo, hi, scratch);
        return;
    }
    if (ly->avx2 && hi >= lo &&
        (hi - lo < 8 ? dp_row_upto8(ly, j, lo, hi - lo + 1) : dp_row_wide(ly, j, lo, hi - lo + 1, scratch)))
        return;
#endif
    dp_row(ly, j, lo, hi, scratch);
}

/* Rows a..b, whose arg-minima lie in [lo, hi] (row j also needs i <= j), by divide and conquer taken breadth first:
 * the rows of one depth do not depend on each other (their windows come from rows of shallower depths), so the CPU
 * overlaps their solves instead of waiting for each window. Every row gets the window the depth-first recursion
 * gives it, so the results are the same. segs: room for 2 (rows + 2) segments of 4 int32 (a, b, lo, hi). */
static void dp_rows(const dp_layer *ly, int64_t a, int64_t b, int64_t lo, int64_t hi, double *scratch, int32_t *segs) {
    int32_t *cur = segs, *next = segs + 4 * (ly->rows + 2);
    int64_t n = 0;
    if (a <= b) {
        cur[0] = (int32_t)a, cur[1] = (int32_t)b, cur[2] = (int32_t)lo, cur[3] = (int32_t)hi;
        n = 1;
    }
    while (n > 0) {
        for (int64_t s = 0; s < n; s++) {
            const int64_t mid = ((int64_t)cur[4 * s] + cur[4 * s + 1]) / 2, top = cur[4 * s + 3];
            dp_solve(ly, mid, cur[4 * s + 2], top < mid ? top : mid, scratch);
        }
        int64_t m = 0;
        for (int64_t s = 0; s < n; s++) {
            const int32_t sa = cur[4 * s], sb = cur[4 * s + 1], slo = cur[4 * s + 2], shi = cur[4 * s + 3];
            const int32_t mid = (int32_t)(((int64_t)sa + sb) / 2);
            if (sa <= mid - 1) {
                next[4 * m] = sa, next[4 * m + 1] = mid - 1, next[4 * m + 2] = slo, next[4 * m + 3] = ly->R[mid];
                m++;
            }
            if (mid + 1 <= sb) {
                next[4 * m] = mid + 1, next[4 * m + 1] = sb, next[4 * m + 2] = ly->L[mid], next[4 * m + 3] = shi;
                m++;
            }
        }
        int32_t *t = cur;
        cur = next;
        next = t;
        n = m;
    }
}

/* ------------------------------------------------------------------ the layers, one after the other
 * On two threads the whole fit is one parallel region: for each layer both threads solve its middle row (thread 1
 * into its own copy of the row's outputs: the same values, from the same inputs and window), then each solves one
 * half, bounded by that row's window ends, and one barrier of the two threads ends the layer. A region per layer
 * (253 of ~40 us for k = 255) waited for the idle worker's wake-up each time (see gefen_threads.c): the fit took
 * 17-21 ms instead of 10 ms inside a busy process. Thread 1 waiting at a barrier for thread 0's middle row
 * instead of solving it too cost 11-13 % of the fit (Zen 1, k = 255, A = 4096: 37.5 -> 32.4 ms). */
typedef struct {
    const double *W, *X, *Q;
    double *buf[2];             /* F of the odd / even layers (layer 1 in buf[1]) */
    int32_t *L, *R, *args;      /* args: (k, rows) */
    double *scratch;
    int32_t *segs;
    int64_t k, rows;
    int avx2, avx512;
    double slack0, slack1;
    team_barrier barrier;
    double *own_F;       /* (rows,) thread 1's copy of each layer's middle row: F, then arg, L, R in own_idx */
    int32_t *own_idx;    /* (3, rows) */
} fit_ctx;

/* Layer c's record (its F from the previous layer's, its tolerance from max |F| of that layer). */
static dp_layer fit_layer(const fit_ctx *f, int64_t c) {
    const double *F_prev = f->buf[(c - 1) & 1];
    double most = 0.0;
    for (int64_t j = 0; j < f->rows; j++)
        if (fabs(F_prev[j]) > most) most = fabs(F_prev[j]);
    return (dp_layer){f->W, f->X, f->Q, F_prev, f->buf[c & 1], f->L, f->R, f->args + c * f->rows, f->scratch, c,
                      f->rows, f->avx2, f->avx512, 8.0 * (f->slack0 + f->slack1 * most), f->segs};
}

/* Layers 2 .. k - 1 on one thread (team of one: the same rows in the same windows). */
static void fit_layers_serial(fit_ctx *f) {
    for (int64_t c = 2; c < f->k; c++) {
        const dp_layer ly = fit_layer(f, c);
        dp_rows(&ly, 0, f->rows - 1, 0, f->rows - 1, f->scratch, f->segs);
    }
}

static void fit_region(void *data) {
    fit_ctx *f = (fit_ctx *)data;
    const int64_t team = g_num_threads(), me = g_thread_num(), rows = f->rows, mid = (rows - 1) / 2;
    if (team < 2) { /* the runtime gave one thread */
        fit_layers_serial(f);
        return;
    }
    if (me > 1) return;
    int phase = 0;
    for (int64_t c = 2; c < f->k; c++) {
        const dp_layer ly = fit_layer(f, c); /* both threads: the same values (F_prev is complete) */
        if (me == 0) {
            dp_solve(&ly, mid, 0, mid, f->scratch);
            dp_rows(&ly, 0, mid - 1, 0, f->R[mid], f->scratch, f->segs);
        } else {
            dp_layer own = ly;
            own.F = f->own_F, own.arg = f->own_idx, own.L = f->own_idx + rows, own.R = f->own_idx + 2 * rows;
            double *scratch = f->scratch + rows + 8;
            dp_solve(&own, mid, 0, mid, scratch);
            dp_rows(&ly, mid + 1, rows - 1, own.L[mid], rows - 1, scratch, f->segs + 8 * (rows + 2));
        }
        team_wait(&f->barrier, 2, &phase); /* the layer is complete before the next one reads it */
    }
}

/* Every layer of a fit: one parallel region of two threads when threads >= 2 and the layers are wide enough to
 * share (every row's values do not depend on which rows were solved before it, so the split changes nothing). */
static void fit_layers(fit_ctx *f, int64_t threads) {
    if (threads < 2 || f->rows < 512 || !g_parallel) {
        fit_layers_serial(f);
        return;
    }
    atomic_init(&f->barrier.arrived, 0);
    atomic_init(&f->barrier.phase, 0);
    g_parallel(fit_region, f, 2, 0);
}

static double pinned_or_free(double w, double x, double q, int pin) {
    if (pin < 0) return q + 2.0 * x + w;
    if (pin > 0) return q - 2.0 * x + w;
    return q - x * x / w;
}

/* The k centres (ascending) of the optimal partition of A sorted points with prefix sums W, X, Q (A + 1 each,
 * W[0] = X[0] = Q[0] = 0 not required: differences are taken). Needs 2 <= k <= A. Returns OK, ERR_ARGS or
 * ERR_NOMEM (then centres is untouched). */
int gefen_kmeans_centres(const double *W, const double *X, const double *Q, int64_t A, int64_t k,
                         int64_t force_endpoints, double slack0, double slack1, double *centres, int64_t threads) {
    if (!W || !X || !Q || !centres || k < 2 || A < k || A > (int64_t)1 << 30) return ERR_ARGS;
    const int64_t rows = A - k + 1;
    /* F and G (the layers' F) and copies of W, X, Q, each with 8 zeros past its end for dp_values4's loads */
    double *F = (double *)calloc((size_t)rows + 8, sizeof(double));
    double *G = (double *)calloc((size_t)rows + 8, sizeof(double));
    double *wxq = (double *)calloc((size_t)(A + 9) * 3, sizeof(double));
    double *scratch = (double *)malloc((size_t)(rows + 8) * 2 * sizeof(double)); /* per half: rows + 8 */
    double *out = (double *)malloc((size_t)k * sizeof(double));
    int32_t *L = (int32_t *)malloc((size_t)rows * sizeof(int32_t));
    int32_t *R = (int32_t *)malloc((size_t)rows * sizeof(int32_t));
    int32_t *segs = (int32_t *)malloc((size_t)(rows + 2) * 16 * sizeof(int32_t));
    int32_t *args = (int32_t *)malloc((size_t)rows * (size_t)k * sizeof(int32_t)); /* row c: layer c's arg-min */
    double *own_F = (double *)malloc((size_t)rows * sizeof(double)); /* see fit_ctx: one element of each is used */
    int32_t *own_idx = (int32_t *)malloc((size_t)rows * 3 * sizeof(int32_t));
    if (!F || !G || !wxq || !scratch || !out || !L || !R || !segs || !args || !own_F || !own_idx) {
        free(F), free(G), free(scratch), free(out), free(L), free(R), free(segs), free(args), free(own_F);
        free(own_idx), free(wxq);
        return ERR_NOMEM;
    }
    memcpy(wxq, W, (size_t)(A + 1) * sizeof(double));
    memcpy(wxq + (A + 9), X, (size_t)(A + 1) * sizeof(double));
    memcpy(wxq + 2 * (A + 9), Q, (size_t)(A + 1) * sizeof(double));
    W = wxq, X = wxq + (A + 9), Q = wxq + 2 * (A + 9);
    const int pin = force_endpoints ? 1 : 0, avx2 = active_level() >= LEVEL_AVX2;
    const int avx512 = active_level() >= LEVEL_AVX512;
    for (int64_t j = 0; j < rows; j++) /* cluster 1 ends at e = 1 + j */
        G[j] = 0.0 + pinned_or_free(W[1 + j] - W[0], X[1 + j] - X[0], Q[1 + j] - Q[0], -pin);
    fit_ctx fit = {W, X, Q, {F, G}, L, R, args, scratch, segs, k, rows, avx2, avx512, slack0, slack1, {0, 0},
                   own_F, own_idx};
    fit_layers(&fit, threads);
    const double *last = fit.buf[(k - 1) & 1]; /* F of layer k - 1 */
    /* the last cluster runs from s = k + i to A */
    int64_t i = 0;
    double best = INFINITY;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t s1 = k - 1 + r;
        const double v = last[r] + pinned_or_free(W[A] - W[s1], X[A] - X[s1], Q[A] - Q[s1], pin);
        if (v < best) best = v, i = r;
    }
    out[k - 1] = pin ? 1.0 : (X[A] - X[k - 1 + i]) / (W[A] - W[k - 1 + i]);
    for (int64_t c = k - 1; c >= 2; c--) {
        const int64_t j = i, e = c + j;
        i = args[c * rows + j];
        out[c - 1] = (X[e] - X[c - 1 + i]) / (W[e] - W[c - 1 + i]);
    }
    out[0] = pin ? -1.0 : (X[1 + i] - X[0]) / (W[1 + i] - W[0]);
    memcpy(centres, out, (size_t)k * sizeof(double)); /* ascending by construction; the caller sorts anyway */
    free(F), free(G), free(scratch), free(out), free(L), free(R), free(segs), free(args), free(own_F), free(own_idx);
    free(wxq);
    return OK;
}

/* ------------------------------------------------------------------ the codebook histogram (algorithm.md 4.2) */
/* Per block of `period` elements: a = max|g| (1 where a = 0), u = g / a in fp32, bin = clamp(floor((u + 1) * 2048),
 * 0, 4095), as gefen.math.codebook.accumulate_histogram_ computes it. Integer counts: any order gives the same sum. */
/* Per thread: uint32 counts (16 KiB, in the L1 cache; one copy: the bins of a peaked distribution are spread over
 * ~1000s of bins, so interleaved copies only add cache misses), moved into int64 totals before any could wrap. */
#ifndef HIST_FLUSH_ELEMENTS /* the sanitizer test builds with a small one, so that the move is exercised */
#define HIST_FLUSH_ELEMENTS ((int64_t)1 << 30)
#endif

typedef struct {
    char before[64]; /* a cache line between one thread's counts and the next one's pending / bad (false sharing) */
    uint32_t small[4096];
    int64_t total[4096];
    int64_t pending; /* elements counted in small since its last move into total */
    int bad;         /* a non-finite value was seen */
    char after[64];
} hist_counts;

typedef struct {
    const float *g;
    int64_t period, blocks_per_task, blocks;
    float bound;          /* > 0: a block whose max |g| exceeds it is refused like a non-finite one */
    hist_counts *partial; /* (threads,) */
    int avx2, avx512;
} hist_ctx;

static void hist_flush(hist_counts *c) {
    for (int k = 0; k < 4096; k++) c->total[k] += c->small[k], c->small[k] = 0;
    c->pending = 0;
}

#if GEFEN_X86
__attribute__((target("avx2,fma"))) static int64_t hist_bins_avx2(const float *x, int64_t n, float a,
                                                                   int32_t *bins) {
    const __m256 va = _mm256_set1_ps(a), inv = _mm256_set1_ps(1.0f / a), scale = _mm256_set1_ps(2048.0f);
    const __m256i top = _mm256_set1_epi32(4095), zero = _mm256_setzero_si256();
    const int markstein = a >= 0x1p-64f && a <= 0x1p64f; /* u = x / a correctly rounded, as hist_bins_avx512 */
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        __m256 u;
        if (markstein) {
            const __m256 q = _mm256_mul_ps(v, inv);
            u = _mm256_fmadd_ps(_mm256_fnmadd_ps(q, va, v), inv, q);
        } else {
            u = _mm256_div_ps(v, va);
        }
        /* (u + 1) * 2048 = fma(u, 2048, 2048): the scaling by 2048 is exact; >= 0, so trunc = floor */
        const __m256i b = _mm256_cvttps_epi32(_mm256_fmadd_ps(u, scale, scale));
        _mm256_storeu_si256((__m256i *)(bins + i), _mm256_min_epi32(_mm256_max_epi32(b, zero), top));
    }
    return i;
}

/* AVX-512: max |x| as the unsigned maximum of the bit patterns with the sign cleared (the order of the magnitudes
 * for finite values; an infinity or a NaN is above every finite one), and u = x / a by Markstein's correction of
 * x * (1/a), the correctly rounded quotient (true division outside [2^-64, 2^64]), as the VBMI step divides. The
 * bin: fma(u, 2048, 2048) = (u + 1) * 2048 exactly (scaling by a power of two commutes with rounding), in
 * [0, 4096] as |u| <= 1 (the clamp at 0 only keeps every index in bounds whatever happens). */
#define T512H __attribute__((target("avx512f,avx512dq")))
T512H static int hist_max_avx512(const float *x, int64_t n, float *a) {
    const __m512i absmask = _mm512_set1_epi32(0x7fffffff);
    __m512i mx = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) mx = _mm512_max_epu32(mx, _mm512_and_si512(_mm512_loadu_si512(x + i), absmask));
    uint32_t m = _mm512_reduce_max_epu32(mx);
    for (; i < n; i++) {
        uint32_t b;
        memcpy(&b, x + i, 4);
        b &= 0x7fffffffu;
        m = b > m ? b : m;
    }
    memcpy(a, &m, 4);
    return m <= 0x7f7fffffu; /* FLT_MAX's pattern: above it lie the infinities and the NaNs */
}

T512H static int64_t hist_bins_avx512(const float *x, int64_t n, float a, int32_t *bins) {
    const __m512 va = _mm512_set1_ps(a), inv = _mm512_set1_ps(1.0f / a), scale = _mm512_set1_ps(2048.0f);
    const __m512i top = _mm512_set1_epi32(4095), zero = _mm512_setzero_si512();
    const int markstein = a >= 0x1p-64f && a <= 0x1p64f;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        __m512 u;
        if (markstein) {
            const __m512 q = _mm512_mul_ps(v, inv);
            u = _mm512_fmadd_ps(_mm512_fnmadd_ps(q, va, v), inv, q);
        } else {
            u = _mm512_div_ps(v, va);
        }
        const __m512i b = _mm512_cvttps_epi32(_mm512_fmadd_ps(u, scale, scale));
        _mm512_storeu_si512(bins + i, _mm512_min_epi32(_mm512_max_epi32(b, zero), top)); /* max: bounds only */
    }
    return i;
}

#ifndef HIST_PREFETCH
#define HIST_PREFETCH 1024
#endif
/* max |x[0..n)| into *a (0 when all zero); returns 0 when a value is NaN or infinite. */
__attribute__((target("avx2"))) static int hist_max_avx2(const float *x, int64_t n, float *a) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 big = _mm256_set1_ps(3.4028234663852886e38f);
    __m256 mx = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        _mm_prefetch((const char *)(x + i + HIST_PREFETCH), _MM_HINT_T0);
        const __m256 v = _mm256_and_ps(_mm256_loadu_ps(x + i), absmask);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, big, _CMP_NLE_UQ));
        mx = _mm256_max_ps(mx, v);
    }
    float lanes[8], m = 0.0f;
    _mm256_storeu_ps(lanes, mx);
    for (int k = 0; k < 8; k++) m = lanes[k] > m ? lanes[k] : m;
    int finite = !_mm256_movemask_ps(bad);
    for (; i < n; i++) {
        const float v = fabsf(x[i]);
        finite &= v <= 3.4028234663852886e38f;
        m = v > m ? v : m;
    }
    *a = m;
    return finite;
}
#endif

static int hist_max_scalar(const float *x, int64_t n, float *a) {
    float m = 0.0f;
    int finite = 1;
    for (int64_t i = 0; i < n; i++) {
        const float v = fabsf(x[i]);
        finite &= v <= 3.4028234663852886e38f; /* false for inf and NaN */
        m = v > m ? v : m;
    }
    *a = m;
    return finite;
}

static void hist_task(const void *ctx_, int64_t task, int64_t thread) {
    const hist_ctx *h = (const hist_ctx *)ctx_;
    hist_counts *c = h->partial + thread;
    uint32_t *counts = c->small;
    int32_t bins[1024];
    int64_t b0 = task * h->blocks_per_task, b1 = b0 + h->blocks_per_task;
    if (b1 > h->blocks) b1 = h->blocks;
    if (h->period == 1) { /* one-element blocks (biases, norm weights): u = x / |x| = -1 or +1 exactly, 0 for x = 0 */
        if (c->pending + (b1 - b0) > HIST_FLUSH_ELEMENTS) hist_flush(c);
        c->pending += b1 - b0;
        for (int64_t b = b0; b < b1; b++) {
            const float x = h->g[b], a = fabsf(x);
            if (!(a <= 3.4028234663852886e38f) || (h->bound > 0.0f && a > h->bound)) {
                c->bad = 1;
                return;
            }
            counts[x < 0.0f ? 0 : x > 0.0f ? 4095 : 2048]++;
        }
        return;
    }
    for (int64_t b = b0; b < b1; b++) {
        const float *x = h->g + b * h->period;
        float a = 0.0f;
#if GEFEN_X86
        const int finite = h->avx512 ? hist_max_avx512(x, h->period, &a)
                           : h->avx2 ? hist_max_avx2(x, h->period, &a)
                                     : hist_max_scalar(x, h->period, &a);
#else
        const int finite = hist_max_scalar(x, h->period, &a);
#endif
        if (!finite || (h->bound > 0.0f && a > h->bound)) {
            c->bad = 1;
            return;
        }
        if (!(a > 0.0f)) a = 1.0f;
        for (int64_t j = 0; j < h->period; j += 1024) {
            const int64_t n = h->period - j < 1024 ? h->period - j : 1024;
            if (c->pending + n > HIST_FLUSH_ELEMENTS) hist_flush(c);
            c->pending += n;
            int64_t i = 0;
#if GEFEN_X86
            if (h->avx512) i = hist_bins_avx512(x + j, n, a, bins);
            else if (h->avx2) i = hist_bins_avx2(x + j, n, a, bins);
#endif
            for (; i < n; i++) {
                float t = (x[j + i] / a + 1.0f) * 2048.0f;
                bins[i] = t < 4095.0f ? (int32_t)t : 4095;
            }
            /* by fours, the four bins loaded first (GCC -O2 keeps the plain loop rolled, one load-increment pair
             * per turn): Zen 1, the whole histogram on one thread, 1.27 -> 1.08 ns per element */
            for (i = 0; i + 4 <= n; i += 4) {
                const int32_t b0 = bins[i], b1 = bins[i + 1], b2 = bins[i + 2], b3 = bins[i + 3];
                counts[b0]++;
                counts[b1]++;
                counts[b2]++;
                counts[b3]++;
            }
            for (; i < n; i++) counts[bins[i]]++;
        }
    }
}

/* counts[0..4096) += the histogram of g (numel fp32 values, blocks of `period`). bound > 0 also refuses a value with
 * |g| > bound (fp32 compare; the optimizer's usable bound, so that this read is its first step's NaN/Inf check).
 * Returns OK, ERR_ARGS (bad sizes or bound), ERR_UNUSABLE (a NaN, an infinity or a value beyond bound: counts
 * untouched) or ERR_NOMEM. */
int gefen_histogram(const float *g, int64_t numel, int64_t period, int64_t *counts, int64_t threads, float bound) {
    if (!g || !counts || numel <= 0 || period <= 0 || numel % period != 0 || !(bound >= 0.0f)) return ERR_ARGS;
    if (threads < 1 || numel < PARALLEL_MIN_ELEMENTS) threads = 1;
    hist_counts *partial = (hist_counts *)calloc((size_t)threads, sizeof(hist_counts));
    if (!partial) return ERR_NOMEM;
    const int64_t blocks = numel / period;
    int64_t per_task = TASK_ELEMENTS / period;
    if (per_task < 1) per_task = 1;
    hist_ctx h = {g, period, per_task, blocks, bound, partial, active_level() >= LEVEL_AVX2,
                  active_level() >= LEVEL_AVX512};
    parallel_for_cost((blocks + per_task - 1) / per_task, threads, hist_task, &h, 0);
    int rc = OK;
    for (int64_t t = 0; t < threads; t++)
        if (partial[t].bad) rc = ERR_UNUSABLE;
    if (rc == OK)
        for (int64_t t = 0; t < threads; t++)
            for (int k = 0; k < 4096; k++) counts[k] += partial[t].total[k] + partial[t].small[k];
    free(partial);
    return rc;
}
