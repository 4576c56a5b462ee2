/*
 * The step's statistics pass of factored second moments (row and column sums of g^2), the usability check of
 * the gradients (nonfinite="skip"/"raise"), and the factored moments and step-size roots from those sums
 * (factored_sums before the FSDP2 reduce, factored_roots after it). Included by gefen_kernels.c (one shared
 * library, one translation unit) after the x86 passes, whose load helpers it uses.
 */
/* ------------------------------------------------------------------ entry point */
/* Elements per task of the block loop; a fixed number, so the split never depends on the thread count. */
#define TASK_ELEMENTS 32768
/* Below this many elements the step runs on the calling thread (waking the pool costs more). */
#define PARALLEL_MIN_ELEMENTS 65536

/* ------------------------------------------------------------------ factored statistics (pass A) */
/* Sum of g^2 over one row [base, base + C) (returned) and g^2 added to the column partials col[0..C). Each g^2 is
 * rounded to fp32 (as the reference squares in fp32) and accumulated in fp64, so the fp32 mean squares are the
 * correctly rounded means up to rare ties, whatever the order: every ISA and thread count gives the same values. */
typedef double (*row_fn)(const gefen_step_args *, int64_t base, int64_t C, double *col);
typedef void (*rows4_fn)(const gefen_step_args *, int64_t base, int64_t C, double *col, double out[4]);

static double row_sq_scalar_from(const gefen_step_args *a, int64_t base, int64_t c, int64_t C, double *col,
                                 double acc) {
    for (; c < C; c++) {
        float g = load1(a->grad, base + c, a->grad_dtype);
        double g2 = (double)(g * g);
        acc += g2;
        col[c] += g2;
    }
    return acc;
}
static double row_sq_scalar(const gefen_step_args *a, int64_t base, int64_t C, double *col) {
    return row_sq_scalar_from(a, base, 0, C, col, 0.0);
}
#if GEFEN_X86
/* g^2 of 16 gradient elements in fp32, widened to two fp64 vectors (elements 0-7, 8-15). */
T5 static inline __attribute__((always_inline)) void sq_wide16(const gefen_step_args *a, int64_t i, __m512d *lo,
                                                               __m512d *hi, const int gdt) {
    __m512 g = ld16(a->grad, i, gdt);
    __m512 g2 = _mm512_mul_ps(g, g);
    *lo = _mm512_cvtps_pd(_mm512_castps512_ps256(g2));
    *hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(g2), 1)));
}
T5 static INLINE double row_sq_avx512_body(const gefen_step_args *a, int64_t base, int64_t C, double *col,
                                          const int gdt) {
    __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
    int64_t c = 0;
    for (; c + 16 <= C; c += 16) {
        __m512d lo, hi;
        sq_wide16(a, base + c, &lo, &hi, gdt);
        s0 = _mm512_add_pd(s0, lo);
        s1 = _mm512_add_pd(s1, hi);
        _mm512_storeu_pd(col + c, _mm512_add_pd(_mm512_loadu_pd(col + c), lo));
        _mm512_storeu_pd(col + c + 8, _mm512_add_pd(_mm512_loadu_pd(col + c + 8), hi));
    }
    double acc = _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
    return row_sq_scalar_from(a, base, c, C, col, acc);
}
T5 static double row_sq_avx512(const gefen_step_args *a, int64_t base, int64_t C, double *col) {
    if (a->grad_dtype == DT_F32) return row_sq_avx512_body(a, base, C, col, DT_F32);
    if (a->grad_dtype == DT_BF16) return row_sq_avx512_body(a, base, C, col, DT_BF16);
    return row_sq_avx512_body(a, base, C, col, DT_F16);
}
/* Four rows at once, the same sums as four row_sq_avx512 calls in row order (each row's two lane accumulators,
 * each column partial added row 0, 1, 2, 3 in turn), so bit-identical; the column partials are loaded and stored
 * once per four rows instead of once per row. Used from ROWS4_MIN_COLS columns on: there the partials fill L1 and
 * competed with the gradient stream; below it the four row streams cost more than they save (measured on Zen 4,
 * 1 thread: 8192 x 1408 in 2.5 ms one row at a time, 4.9 ms four rows; 4096 x 4096 in 6.4 ms vs 5.0 ms; the AVX2
 * pair on Zen 1: 256 x 4096 1.0 -> 0.64 ns/element, 8192 x 512 from DRAM 0.74 -> 1.0). */
#define ROWS4_MIN_COLS 4096
T5 static INLINE void rows4_sq_avx512_body(const gefen_step_args *a, int64_t base, int64_t C, double *col,
                                          double out[4], const int gdt) {
    __m512d s[4][2];
    for (int r = 0; r < 4; r++) s[r][0] = s[r][1] = _mm512_setzero_pd();
    int64_t c = 0;
    for (; c + 16 <= C; c += 16) {
        __m512d clo = _mm512_loadu_pd(col + c), chi = _mm512_loadu_pd(col + c + 8);
        UNROLL4
        for (int r = 0; r < 4; r++) {
            __m512d lo, hi;
            sq_wide16(a, base + r * C + c, &lo, &hi, gdt);
            s[r][0] = _mm512_add_pd(s[r][0], lo);
            s[r][1] = _mm512_add_pd(s[r][1], hi);
            clo = _mm512_add_pd(clo, lo);
            chi = _mm512_add_pd(chi, hi);
        }
        _mm512_storeu_pd(col + c, clo);
        _mm512_storeu_pd(col + c + 8, chi);
    }
    for (int r = 0; r < 4; r++) {
        double acc = _mm512_reduce_add_pd(_mm512_add_pd(s[r][0], s[r][1]));
        out[r] = row_sq_scalar_from(a, base + r * C, c, C, col, acc);
    }
}
T5 static void rows4_sq_avx512(const gefen_step_args *a, int64_t base, int64_t C, double *col, double out[4]) {
    if (a->grad_dtype == DT_F32) rows4_sq_avx512_body(a, base, C, col, out, DT_F32);
    else if (a->grad_dtype == DT_BF16) rows4_sq_avx512_body(a, base, C, col, out, DT_BF16);
    else rows4_sq_avx512_body(a, base, C, col, out, DT_F16);
}
/* g^2 of 8 gradient elements in fp32, widened to two fp64 vectors (elements 0-3, 4-7). */
T2 static inline __attribute__((always_inline)) void sq_wide8(const gefen_step_args *a, int64_t i, __m256d *lo,
                                                              __m256d *hi, const int gdt) {
    const __m256 g = ld8(a->grad, i, gdt), g2 = _mm256_mul_ps(g, g);
    *lo = _mm256_cvtps_pd(_mm256_castps256_ps128(g2));
    *hi = _mm256_cvtps_pd(_mm256_extractf128_ps(g2, 1));
}
T2 static inline double sum4d(__m256d s0, __m256d s1) {
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(s0, s1));
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}
/* Prefetch distance (elements) of the AVX2 statistics pass and usability check, the step's first reads of the
 * gradients (Zen 1, 1 thread, 8192 x 512 from DRAM: row sums 0.73-0.79 -> 0.59-0.61 ns/element). */
#ifndef STATS_PREFETCH
#define STATS_PREFETCH 1024
#endif
T2 static INLINE double row_sq_avx2_body(const gefen_step_args *a, int64_t base, int64_t C, double *col,
                                        const int gdt) {
    __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
    int64_t c = 0;
    for (; c + 8 <= C; c += 8) {
        __m256d lo, hi;
        _mm_prefetch((const char *)a->grad + (base + c + STATS_PREFETCH) * (gdt == DT_F32 ? 4 : 2), _MM_HINT_T0);
        sq_wide8(a, base + c, &lo, &hi, gdt);
        s0 = _mm256_add_pd(s0, lo);
        s1 = _mm256_add_pd(s1, hi);
        _mm256_storeu_pd(col + c, _mm256_add_pd(_mm256_loadu_pd(col + c), lo));
        _mm256_storeu_pd(col + c + 4, _mm256_add_pd(_mm256_loadu_pd(col + c + 4), hi));
    }
    return row_sq_scalar_from(a, base, c, C, col, sum4d(s0, s1));
}
T2 static double row_sq_avx2(const gefen_step_args *a, int64_t base, int64_t C, double *col) {
    if (a->grad_dtype == DT_F32) return row_sq_avx2_body(a, base, C, col, DT_F32);
    if (a->grad_dtype == DT_BF16) return row_sq_avx2_body(a, base, C, col, DT_BF16);
    return row_sq_avx2_body(a, base, C, col, DT_F16);
}
/* Four rows at once, the same sums as four row_sq_avx2 calls in row order (see rows4_sq_avx512): the column
 * partials are loaded and stored once per four rows. */
T2 static INLINE void rows4_sq_avx2_body(const gefen_step_args *a, int64_t base, int64_t C, double *col,
                                        double out[4], const int gdt) {
    __m256d s[4][2];
    for (int r = 0; r < 4; r++) s[r][0] = s[r][1] = _mm256_setzero_pd();
    int64_t c = 0;
    for (; c + 8 <= C; c += 8) {
        __m256d clo = _mm256_loadu_pd(col + c), chi = _mm256_loadu_pd(col + c + 4);
        UNROLL4
        for (int r = 0; r < 4; r++) {
            __m256d lo, hi;
            sq_wide8(a, base + r * C + c, &lo, &hi, gdt);
            s[r][0] = _mm256_add_pd(s[r][0], lo);
            s[r][1] = _mm256_add_pd(s[r][1], hi);
            clo = _mm256_add_pd(clo, lo);
            chi = _mm256_add_pd(chi, hi);
        }
        _mm256_storeu_pd(col + c, clo);
        _mm256_storeu_pd(col + c + 4, chi);
    }
    for (int r = 0; r < 4; r++) out[r] = row_sq_scalar_from(a, base + r * C, c, C, col, sum4d(s[r][0], s[r][1]));
}
T2 static void rows4_sq_avx2(const gefen_step_args *a, int64_t base, int64_t C, double *col, double out[4]) {
    if (a->grad_dtype == DT_F32) rows4_sq_avx2_body(a, base, C, col, out, DT_F32);
    else if (a->grad_dtype == DT_BF16) rows4_sq_avx2_body(a, base, C, col, out, DT_BF16);
    else rows4_sq_avx2_body(a, base, C, col, out, DT_F16);
}
#endif

typedef struct {
    const gefen_step_args *a;
    double *row_sq;   /* (R,) */
    double *col_part; /* (tasks, C) */
    int64_t rows_per_task;
    int level;
} stats_ctx;

static void stats_task(const void *ctx_, int64_t task, int64_t thread) {
    (void)thread;
    const stats_ctx *ctx = (const stats_ctx *)ctx_;
    const gefen_step_args *a = ctx->a;
    const int64_t C = a->cols;
    int64_t r0 = task * ctx->rows_per_task, r1 = r0 + ctx->rows_per_task;
    if (r1 > a->rows) r1 = a->rows;
    double *col = ctx->col_part + task * C;
    memset(col, 0, (size_t)C * sizeof(double));
    row_fn fn = row_sq_scalar;
    rows4_fn fn4 = 0; /* four rows per call where the ISA has one (same sums as four calls of fn) */
#if GEFEN_X86
    if (ctx->level >= LEVEL_AVX512) {
        fn = row_sq_avx512;
        fn4 = rows4_sq_avx512;
    } else if (ctx->level == LEVEL_AVX2) {
        fn = row_sq_avx2;
        fn4 = rows4_sq_avx2;
    }
#endif
    int64_t r = r0;
    if (fn4 && C >= ROWS4_MIN_COLS)
        for (; r + 4 <= r1; r += 4) fn4(a, r * C, C, col, ctx->row_sq + r);
    for (; r < r1; r++) ctx->row_sq[r] = fn(a, r * C, C, col);
}


/* ------------------------------------------------------------------ the usability check of the gradients */
/* nonfinite="skip"/"raise" (records with grad_bound > 0): every gradient value must be within the bound, |g| <=
 * grad_bound in fp32, NaN failing (gefen.amp's rule, which keeps every sum of squares finite in fp32). It runs
 * between the statistics and the first write: a record that fails it refuses the whole call, nothing changed. */
static int usable_scalar(const gefen_step_args *a, int64_t i0, int64_t i1) {
    const float bound = a->grad_bound;
    for (int64_t i = i0; i < i1; i++)
        if (!(fabsf(load1(a->grad, i, a->grad_dtype)) <= bound)) return 0;
    return 1;
}
#if GEFEN_X86
T5 static int usable_avx512(const gefen_step_args *a, int64_t i0, int64_t i1) {
    const __m512 bound = _mm512_set1_ps(a->grad_bound);
    __mmask16 ok = 0xffff;
    int64_t i = i0;
    for (; i + 16 <= i1; i += 16)
        ok &= _mm512_cmp_ps_mask(_mm512_abs_ps(ld16(a->grad, i, a->grad_dtype)), bound, _CMP_LE_OQ);
    return ok == 0xffff && usable_scalar(a, i, i1);
}
T2 static int usable_avx2(const gefen_step_args *a, int64_t i0, int64_t i1) {
    const __m256 bound = _mm256_set1_ps(a->grad_bound);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    int64_t i = i0;
    for (; i + 8 <= i1; i += 8) {
        _mm_prefetch((const char *)a->grad + (i + STATS_PREFETCH) * (a->grad_dtype == DT_F32 ? 4 : 2), _MM_HINT_T0);
        ok = _mm256_and_ps(ok,
                           _mm256_cmp_ps(_mm256_and_ps(ld8(a->grad, i, a->grad_dtype), absmask), bound, _CMP_LE_OQ));
    }
    return _mm256_movemask_ps(ok) == 0xff && usable_scalar(a, i, i1);
}
#endif
/* 1 when every gradient value of [i0, i1) passes (see above). */
static int usable_range(const gefen_step_args *a, int64_t i0, int64_t i1, int level) {
#if GEFEN_X86
    if (level >= LEVEL_AVX512) return usable_avx512(a, i0, i1);
    if (level == LEVEL_AVX2) return usable_avx2(a, i0, i1);
#else
    (void)level;
#endif
    return usable_scalar(a, i0, i1);
}
/* A factored record's check from the row sums of its statistics pass: a value beyond the bound has fp32(g*g) >=
 * fp32(bound*bound) (rounding is monotone), and a row's fp64 sum of non-negative squares is at least each of them;
 * so only a row whose sum reaches fp32(bound*bound), or is NaN, is read again, element by element (never, for
 * usable gradients: the check costs O(rows)). */
static int factored_usable(const gefen_step_args *a, const double *row_sq, int level) {
    const double limit = (double)(a->grad_bound * a->grad_bound);
    for (int64_t r = 0; r < a->rows; r++)
        if (!(row_sq[r] < limit) && !usable_range(a, r * a->cols, (r + 1) * a->cols, level)) return 0;
    return 1;
}

/* The factored second moment of one parameter, part 1: its column sums of g^2 (this rank's rows) into col_sq, the
 * updated row moments into the row-root slots (published by factored_roots) and their fp64 total. */
static double factored_sums(const gefen_step_args *a, double *sums, int64_t stat_tasks, float *roots) {
    const int64_t R = a->rows, C = a->cols;
    float *v_row_new = roots;
    double *row_sq = sums, *col_sq = sums + R, *part = sums + R + C;
    memset(col_sq, 0, (size_t)C * sizeof(double));
    for (int64_t t = 0; t < stat_tasks; t++)
        for (int64_t c = 0; c < C; c++) col_sq[c] += part[t * C + c];
    double total = 0.0;
    for (int64_t r = 0; r < R; r++) {
        float v = fmaf((float)(row_sq[r] / (double)C), a->one_minus_beta2, a->v_row[r] * a->beta2);
        v_row_new[r] = v;
        total += v;
    }
    return total;
}

/* Part 2: from the column sums and row-moment total over all R_all rows (this rank's, or all ranks' once reduced),
 * update v_row and v_col and compute the roots of the step size. */
static void factored_roots(const gefen_step_args *a, const double *sums, float *roots, double total, int64_t R_all) {
    const int64_t R = a->rows, C = a->cols;
    float *row_root = roots, *col_root = roots + R;
    const double *col_sq = sums + R;
    for (int64_t r = 0; r < R; r++) a->v_row[r] = row_root[r];
    for (int64_t c = 0; c < C; c++) {
        float v = fmaf((float)(col_sq[c] / (double)R_all), a->one_minus_beta2, a->v_col[c] * a->beta2);
        a->v_col[c] = v;
        col_root[c] = sqrtf(v);
    }
    float mean = (float)(total / (double)R_all);
    /* torch's clamp_min: a NaN mean (a NaN gradient under nonfinite="propagate") stays NaN */
    float normaliser = (!(mean < 1.1754943508222875e-38f) ? mean : 1.1754943508222875e-38f) * a->bc2;
    for (int64_t r = 0; r < R; r++) row_root[r] = sqrtf(a->v_row[r] / normaliser);
}
