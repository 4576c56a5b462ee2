/*
 * The period search's scores (algorithm.md section 3.2 step 3), natively. Included by gefen_kernels.c (one shared
 * library, one translation unit).
 *
 * Input: one fp32 gradient g (n values). x_i = g_i * g_i in fp32, promoted to float64, l_i = ln(x_i + 1e-12);
 * the logs are centred on their mean and summed into a float64 prefix P (P[0] = 0, P[i + 1] = P[i] + l_i - mean),
 * and the score of a candidate period p is S(p) = mean over b < B - 1 of |m_{b+1} - m_b|, m_b = (P[(b+1)p] -
 * P[bp]) / p, B = n / p: the programme of gefen.math.period.period_scores (the reference). The operations differ
 * from the reference in their rounding only (the reference uses torch's log, mean, cumsum and mean): scores agree
 * to about 1e-12 relative, and every order here is fixed (chunks of PERIOD_CHUNK elements, lanes of 8), so the
 * scores are the same for any thread count and on every ISA (the scalar path replays the AVX2 path's order).
 * When every candidate is a multiple of 8 the prefix holds one value per 8 elements (see group8_scalar).
 *
 * ln: x = 2^e m with m in [sqrt(1/2), sqrt(2)), ln x = e ln2 + 2 atanh(s), s = (m - 1) / (m + 1), the atanh series
 * to z^10 (z = s^2 <= 0.0295: truncation below 1e-18), e ln2 in two parts (fdlibm's split). Every multiply-add is
 * spelled out as fma, so the scalar and AVX2 paths round alike; error a few ulp.
 */

enum { ERR_NONFINITE = -3, ERR_OVERFLOW = -4 };

/* Elements per task of the log and prefix passes (fixed: the chunk sums fix the summation order). */
#define PERIOD_CHUNK 65536

static const double LN2_HI = 6.93147180369123816490e-01, LN2_LO = 1.90821492927058770002e-10;
static const double SQRT2 = 1.41421356237309514547; /* the double nearest sqrt(2), below it */

static inline double ln_positive(double x) { /* x > 0, finite, normal */
    uint64_t b;
    memcpy(&b, &x, 8);
    double e = (double)(int64_t)(b >> 52) - 1023.0;
    uint64_t mb = (b & 0x000fffffffffffffULL) | 0x3ff0000000000000ULL;
    double m;
    memcpy(&m, &mb, 8);
    if (m > SQRT2) {
        m *= 0.5;
        e += 1.0;
    }
    double s = (m - 1.0) / (m + 1.0), z = s * s;
    double poly = 1.0 / 21.0;
    poly = fma(poly, z, 1.0 / 19.0);
    poly = fma(poly, z, 1.0 / 17.0);
    poly = fma(poly, z, 1.0 / 15.0);
    poly = fma(poly, z, 1.0 / 13.0);
    poly = fma(poly, z, 1.0 / 11.0);
    poly = fma(poly, z, 1.0 / 9.0);
    poly = fma(poly, z, 1.0 / 7.0);
    poly = fma(poly, z, 1.0 / 5.0);
    poly = fma(poly, z, 1.0 / 3.0);
    double s2 = s + s;
    double lnm = fma(s2 * z, poly, s2); /* 2s + 2s z (1/3 + z/5 + ...) */
    return fma(e, LN2_HI, lnm + e * LN2_LO);
}

typedef struct {
    const float *g;
    double *prefix; /* (n / group + 1,) */
    int64_t n;
    int64_t group;       /* 1, or 8: one value per 8 elements (the sum of their logs, see group8_scalar) */
    double *chunk_sum;   /* (chunks,) */
    double *chunk_start; /* (chunks,) prefix value before each chunk */
    int *flags;          /* (chunks,): 1 non-finite g, 2 g*g overflowed, 4 some g != 0, 8 some x != x0 */
    float x0;            /* g[0] * g[0] */
    double mean;
    int avx2;
} period_ctx;

/* Logs of elements [i, i1) into out[i + 1 ..], added one by one to *total; flags as in period_ctx. */
static void logs_tail(const float *g, double *out, int64_t i, int64_t i1, float x0, double *total, int *flags) {
    for (; i < i1; i++) {
        const float gi = g[i], x = gi * gi;
        if (!(fabsf(gi) <= 3.4028234663852886e38f)) *flags |= 1;
        else if (!(x <= 3.4028234663852886e38f)) *flags |= 2;
        if (gi != 0.0f) *flags |= 4;
        if (x != x0) *flags |= 8;
        out[i + 1] = (*flags & 3) ? 0.0 : ln_positive((double)x + 1e-12);
        *total += out[i + 1];
    }
}

static inline double sum8(const double lanes[8]) {
    return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

/* Logs of elements [i0, i1) into out[i0 + 1 ..] and their sum: the whole groups of 8 in 8 lanes (lane k takes the
 * elements i0 + j with j % 8 == k, in order), the lanes added as sum8, then the rest one by one (logs_tail). */
static double logs_scalar(const float *g, double *out, int64_t i0, int64_t i1, float x0, int *flags) {
    double lanes[8] = {0};
    const int64_t full = i0 + ((i1 - i0) & ~(int64_t)7);
    double none = 0.0;
    logs_tail(g, out, i0, full, x0, &none, flags);
    for (int64_t i = i0; i < full; i++) lanes[(i - i0) & 7] += out[i + 1];
    double total = sum8(lanes);
    logs_tail(g, out, full, i1, x0, &total, flags);
    return total;
}

#if GEFEN_X86
__attribute__((target("avx2,fma"))) static inline __m256d ln_positive4(__m256d x) {
    const __m256i bits = _mm256_castpd_si256(x);
    const __m256d two52 = _mm256_castsi256_pd(_mm256_set1_epi64x(0x4330000000000000LL));
    __m256d e = _mm256_sub_pd(_mm256_castsi256_pd(_mm256_or_si256(_mm256_srli_epi64(bits, 52), _mm256_castpd_si256(two52))),
                              two52); /* the biased exponent as a double, exactly */
    e = _mm256_sub_pd(e, _mm256_set1_pd(1023.0));
    __m256d m = _mm256_castsi256_pd(_mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi64x(0x000fffffffffffffLL)),
                                                    _mm256_set1_epi64x(0x3ff0000000000000LL)));
    const __m256d high = _mm256_cmp_pd(m, _mm256_set1_pd(SQRT2), _CMP_GT_OQ);
    m = _mm256_blendv_pd(m, _mm256_mul_pd(m, _mm256_set1_pd(0.5)), high);
    e = _mm256_add_pd(e, _mm256_and_pd(high, _mm256_set1_pd(1.0)));
    const __m256d one = _mm256_set1_pd(1.0);
    const __m256d s = _mm256_div_pd(_mm256_sub_pd(m, one), _mm256_add_pd(m, one)), z = _mm256_mul_pd(s, s);
    __m256d poly = _mm256_set1_pd(1.0 / 21.0);
    poly = _mm256_fmadd_pd(poly, z, _mm256_set1_pd(1.0 / 19.0));
    poly = _mm256_fmadd_pd(poly, z, _mm256_set1_pd(1.0 / 17.0));
    poly = _mm256_fmadd_pd(poly, z, _mm256_set1_pd(1.0 / 15.0));
    poly = _mm256_fmadd_pd(poly, z, _mm256_set1_pd(1.0 / 13.0));
    poly = _mm256_fmadd_pd(poly, z, _mm256_set1_pd(1.0 / 11.0));
    poly = _mm256_fmadd_pd(poly, z, _mm256_set1_pd(1.0 / 9.0));
    poly = _mm256_fmadd_pd(poly, z, _mm256_set1_pd(1.0 / 7.0));
    poly = _mm256_fmadd_pd(poly, z, _mm256_set1_pd(1.0 / 5.0));
    poly = _mm256_fmadd_pd(poly, z, _mm256_set1_pd(1.0 / 3.0));
    const __m256d s2 = _mm256_add_pd(s, s);
    const __m256d lnm = _mm256_fmadd_pd(_mm256_mul_pd(s2, z), poly, s2);
    return _mm256_fmadd_pd(e, _mm256_set1_pd(LN2_HI), _mm256_add_pd(lnm, _mm256_mul_pd(e, _mm256_set1_pd(LN2_LO))));
}

/* logs_scalar's groups of 8 of [i0, i1) (the same lanes and order); returns 0 when a value is not finite or
 * squares to an overflow (nothing summed: the caller redoes the chunk in scalar to tell which), else the sum. */
__attribute__((target("avx2,fma"))) static int logs_avx2(const float *g, double *out, int64_t i0, int64_t i1,
                                                         float x0, double *sum, int *flags) {
    const __m256 big = _mm256_set1_ps(3.4028234663852886e38f);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256d delta = _mm256_set1_pd(1e-12);
    __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
    __m256 bad = _mm256_setzero_ps(), nonzero = _mm256_setzero_ps(), varies = _mm256_setzero_ps();
    const __m256 vx0 = _mm256_set1_ps(x0);
    int64_t i = i0;
    for (; i + 8 <= i1; i += 8) {
        const __m256 gi = _mm256_loadu_ps(g + i), x = _mm256_mul_ps(gi, gi);
        /* not (|g| <= max and x <= max): NaN, infinity or an overflowing square */
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_and_ps(x, absmask), big, _CMP_NLE_UQ));
        nonzero = _mm256_or_ps(nonzero, _mm256_cmp_ps(gi, _mm256_setzero_ps(), _CMP_NEQ_UQ));
        varies = _mm256_or_ps(varies, _mm256_cmp_ps(x, vx0, _CMP_NEQ_UQ));
        const __m256d l0 = ln_positive4(_mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(x)), delta));
        const __m256d l1 = ln_positive4(_mm256_add_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)), delta));
        _mm256_storeu_pd(out + i + 1, l0);
        _mm256_storeu_pd(out + i + 5, l1);
        acc0 = _mm256_add_pd(acc0, l0);
        acc1 = _mm256_add_pd(acc1, l1);
    }
    if (_mm256_movemask_ps(bad)) return 0;
    if (_mm256_movemask_ps(nonzero)) *flags |= 4;
    if (_mm256_movemask_ps(varies)) *flags |= 8;
    double lanes[8];
    _mm256_storeu_pd(lanes, acc0);
    _mm256_storeu_pd(lanes + 4, acc1);
    double total = sum8(lanes);
    logs_tail(g, out, i, i1, x0, &total, flags);
    *sum = total;
    return 1;
}
#endif

/* Groups of 8 (when every candidate period is a multiple of 8, only the sums of 8 consecutive logs are ever
 * read): the value of group j (elements 8j .. 8j + 7, y_k = x_k + 1e-12 in float64) is
 * ln((y0 y4)(y1 y5)) + ln((y2 y6)(y3 y7)): two logs instead of eight, each of a product of four factors in
 * [1e-48, 1.4e154] (no overflow or underflow); its rounding is that of the per-element sum to a few ulp. The values
 * of [j0, j1) go to out[j + 1], their sum in 4 lanes (lane k: the groups j0 + 4m + k) added as
 * (l0 + l1) + (l2 + l3), then the last (j1 - j0) % 4 groups one by one. */
static double group8_value(const float *g, int64_t j, float x0, int *flags) {
    double y[8];
    for (int k = 0; k < 8; k++) {
        const float gi = g[8 * j + k], x = gi * gi;
        if (!(fabsf(gi) <= 3.4028234663852886e38f)) *flags |= 1;
        else if (!(x <= 3.4028234663852886e38f)) *flags |= 2;
        if (gi != 0.0f) *flags |= 4;
        if (x != x0) *flags |= 8;
        y[k] = (double)x + 1e-12;
    }
    if (*flags & 3) return 0.0;
    return ln_positive((y[0] * y[4]) * (y[1] * y[5])) + ln_positive((y[2] * y[6]) * (y[3] * y[7]));
}

static double group8_scalar(const float *g, double *out, int64_t j0, int64_t j1, float x0, int *flags) {
    double lanes[4] = {0};
    const int64_t full = j0 + ((j1 - j0) & ~(int64_t)3);
    for (int64_t j = j0; j < j1; j++) out[j + 1] = group8_value(g, j, x0, flags);
    for (int64_t j = j0; j < full; j++) lanes[(j - j0) & 3] += out[j + 1];
    double total = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    for (int64_t j = full; j < j1; j++) total += out[j + 1];
    return total;
}

#if GEFEN_X86
/* y * y' lane by lane for the 8 elements at g: (y0 y4, y1 y5, y2 y6, y3 y7), with the flags' vector tests. */
__attribute__((target("avx2,fma"))) static inline __m256d pair_products8(const float *g, __m256 vx0, __m256 *bad,
                                                                          __m256 *nonzero, __m256 *varies) {
    const __m256 big = _mm256_set1_ps(3.4028234663852886e38f);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256d delta = _mm256_set1_pd(1e-12);
    const __m256 gi = _mm256_loadu_ps(g), x = _mm256_mul_ps(gi, gi);
    *bad = _mm256_or_ps(*bad, _mm256_cmp_ps(_mm256_and_ps(x, absmask), big, _CMP_NLE_UQ));
    *nonzero = _mm256_or_ps(*nonzero, _mm256_cmp_ps(gi, _mm256_setzero_ps(), _CMP_NEQ_UQ));
    *varies = _mm256_or_ps(*varies, _mm256_cmp_ps(x, vx0, _CMP_NEQ_UQ));
    const __m256d lo = _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(x)), delta);
    const __m256d hi = _mm256_add_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)), delta);
    return _mm256_mul_pd(lo, hi);
}

/* group8_scalar for groups [j0, j1), four groups per iteration; returns 0 (nothing summed) when a value is not
 * finite or squares to an overflow, else 1 with the sum in *sum. */
__attribute__((target("avx2,fma"))) static int group8_avx2(const float *g, double *out, int64_t j0, int64_t j1,
                                                           float x0, double *sum, int *flags) {
    const __m256 vx0 = _mm256_set1_ps(x0);
    __m256 bad = _mm256_setzero_ps(), nonzero = _mm256_setzero_ps(), varies = _mm256_setzero_ps();
    __m256d acc = _mm256_setzero_pd();
    int64_t j = j0;
    for (; j + 4 <= j1; j += 4) {
        const __m256d pa = pair_products8(g + 8 * j, vx0, &bad, &nonzero, &varies);
        const __m256d pb = pair_products8(g + 8 * j + 8, vx0, &bad, &nonzero, &varies);
        const __m256d pc = pair_products8(g + 8 * j + 16, vx0, &bad, &nonzero, &varies);
        const __m256d pd = pair_products8(g + 8 * j + 24, vx0, &bad, &nonzero, &varies);
        /* (a0 a1, b0 b1, a2 a3, b2 b3) and (c0 c1, d0 d1, c2 c3, d2 d3) */
        const __m256d ab = _mm256_mul_pd(_mm256_unpacklo_pd(pa, pb), _mm256_unpackhi_pd(pa, pb));
        const __m256d cd = _mm256_mul_pd(_mm256_unpacklo_pd(pc, pd), _mm256_unpackhi_pd(pc, pd));
        const __m256d first = _mm256_permute2f128_pd(ab, cd, 0x20), second = _mm256_permute2f128_pd(ab, cd, 0x31);
        const __m256d v = _mm256_add_pd(ln_positive4(first), ln_positive4(second));
        _mm256_storeu_pd(out + j + 1, v);
        acc = _mm256_add_pd(acc, v);
    }
    if (_mm256_movemask_ps(bad)) return 0;
    if (_mm256_movemask_ps(nonzero)) *flags |= 4;
    if (_mm256_movemask_ps(varies)) *flags |= 8;
    double lanes[4];
    _mm256_storeu_pd(lanes, acc);
    double total = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    for (; j < j1; j++) {
        out[j + 1] = group8_value(g, j, x0, flags);
        total += out[j + 1];
    }
    if (*flags & 3) return 0;
    *sum = total;
    return 1;
}
#endif

static void period_logs_task(const void *ctx_, int64_t t, int64_t thread) {
    (void)thread;
    const period_ctx *c = (const period_ctx *)ctx_;
    const int64_t i0 = t * PERIOD_CHUNK, i1 = i0 + PERIOD_CHUNK < c->n ? i0 + PERIOD_CHUNK : c->n;
    int flags = 0;
    if (c->group == 8) {
#if GEFEN_X86
        if (c->avx2 && group8_avx2(c->g, c->prefix, i0 / 8, i1 / 8, c->x0, &c->chunk_sum[t], &flags)) {
            c->flags[t] = flags;
            return;
        }
        flags = 0;
#endif
        c->chunk_sum[t] = group8_scalar(c->g, c->prefix, i0 / 8, i1 / 8, c->x0, &flags);
        c->flags[t] = flags;
        return;
    }
#if GEFEN_X86
    if (c->avx2 && logs_avx2(c->g, c->prefix, i0, i1, c->x0, &c->chunk_sum[t], &flags)) {
        c->flags[t] = flags;
        return;
    }
    flags = 0;
#endif
    c->chunk_sum[t] = logs_scalar(c->g, c->prefix, i0, i1, c->x0, &flags);
    c->flags[t] = flags;
}

#if GEFEN_X86
/* period_prefix_task's groups of 4 of [i0, i1); returns the first element left, the running value in *run. */
__attribute__((target("avx2"))) static int64_t prefix4_avx2(double *P, int64_t i0, int64_t i1, double mean,
                                                            double *run) {
    const __m256d vmean = _mm256_set1_pd(mean);
    __m256d carry = _mm256_set1_pd(*run);
    int64_t i = i0;
    for (; i + 4 <= i1; i += 4) {
        __m256d d = _mm256_sub_pd(_mm256_loadu_pd(P + i + 1), vmean);             /* d0 d1 d2 d3 */
        __m256d s1 = _mm256_permute4x64_pd(d, 0x90);                              /* d0 d0 d1 d2 */
        s1 = _mm256_blend_pd(s1, _mm256_setzero_pd(), 1);                          /* 0  d0 d1 d2 */
        __m256d a = _mm256_add_pd(d, s1);                                          /* d0 d0+d1 d1+d2 d2+d3 */
        __m256d s2 = _mm256_permute2f128_pd(a, a, 0x08);                           /* 0 0 d0 d0+d1 */
        a = _mm256_add_pd(a, s2); /* d0, d0+d1, (d1+d2)+d0, (d2+d3)+(d0+d1) */
        __m256d out = _mm256_add_pd(carry, a);
        _mm256_storeu_pd(P + i + 1, out);
        carry = _mm256_permute4x64_pd(out, 0xFF);
    }
    double last[4];
    _mm256_storeu_pd(last, carry);
    *run = last[0];
    return i;
}
#endif

/* P[i + 1] = P[i] + (l_i - mean) over one chunk, four at a time: within a group of 4 the partial sums are
 * (d0, d0 + d1, (d1 + d2) + d0, (d2 + d3) + (d0 + d1)), each added to the running value (the AVX2 path's order,
 * replayed by the scalar path). */
static void period_prefix_task(const void *ctx_, int64_t t, int64_t thread) {
    (void)thread;
    const period_ctx *c = (const period_ctx *)ctx_;
    const int64_t per = PERIOD_CHUNK / c->group, len = c->n / c->group; /* values per chunk, in all */
    const int64_t i0 = t * per, i1 = i0 + per < len ? i0 + per : len;
    double *P = c->prefix, run = c->chunk_start[t];
    const double mean = c->mean;
    int64_t i = i0;
#if GEFEN_X86
    if (c->avx2) {
        i = prefix4_avx2(P, i0, i1, mean, &run);
    }
#endif
    for (; i + 4 <= i1; i += 4) {
        double d0 = P[i + 1] - mean, d1 = P[i + 2] - mean, d2 = P[i + 3] - mean, d3 = P[i + 4] - mean;
        double a1 = d0 + d1, a2 = (d1 + d2) + d0, a3 = (d2 + d3) + a1;
        P[i + 1] = run + d0;
        P[i + 2] = run + a1;
        P[i + 3] = run + a2;
        P[i + 4] = run = run + a3;
    }
    for (; i < i1; i++) P[i + 1] = run = run + (P[i + 1] - mean);
}

/* Block differences per task of the scores: a fixed number, so each score's sum has one order (its segments'
 * partial sums, each in order, added in order) whatever the thread count. */
#define SCORE_SEGMENT 32768

typedef struct {
    const double *P;
    const int64_t *cands;
    const int64_t *task_cand, *task_seg; /* (tasks,) */
    double *partial;                     /* (tasks,) */
    int64_t n, group;                    /* P holds one value per group of elements */
} score_ctx;

/* The sum of |m_b - m_{b-1}| over the differences b in [1 + s SCORE_SEGMENT, ...) of one candidate. */
static void period_score_task(const void *ctx_, int64_t t, int64_t thread) {
    (void)thread;
    const score_ctx *c = (const score_ctx *)ctx_;
    const int64_t B = c->n / c->cands[c->task_cand[t]], p = c->cands[c->task_cand[t]] / c->group;
    const int64_t b0 = 1 + c->task_seg[t] * SCORE_SEGMENT, b1 = b0 + SCORE_SEGMENT < B ? b0 + SCORE_SEGMENT : B;
    const double width = (double)(p * c->group), *P = c->P;
    double prev = (P[b0 * p] - P[(b0 - 1) * p]) / width, total = 0.0;
    for (int64_t b = b0; b < b1; b++) {
        const double m = (P[(b + 1) * p] - P[b * p]) / width;
        total += fabs(m - prev);
        prev = m;
    }
    c->partial[t] = total;
}

/* The scores of n_cands candidate periods (each dividing n with n / p >= 2) of the gradient g (n fp32 values) into
 * scores[0..n_cands) (all exactly 0 when every g_i * g_i is the same value). *nonzero is set to 1 when some
 * g_i != 0, else 0. work: n + 1 doubles of scratch, or 0 (then allocated here: a caller that searches many tensors
 * passes one buffer and saves its page faults). Returns OK, ERR_ARGS, ERR_NOMEM, ERR_NONFINITE (a NaN or an
 * infinity in g) or ERR_OVERFLOW (some g_i * g_i overflows fp32: the caller uses the reference); scores are
 * written only on OK. */
int gefen_period_scores(const float *g, int64_t n, const int64_t *cands, int64_t n_cands, double *scores,
                        int64_t *nonzero, double *work, int64_t threads) {
    if (!g || n <= 0 || n_cands < 0 || (n_cands > 0 && (!cands || !scores)) || !nonzero) return ERR_ARGS;
    for (int64_t k = 0; k < n_cands; k++)
        if (cands[k] < 1 || n % cands[k] != 0 || n / cands[k] < 2) return ERR_ARGS;
    if (threads < 1 || n < PARALLEL_MIN_ELEMENTS) threads = 1;
    const int64_t chunks = (n + PERIOD_CHUNK - 1) / PERIOD_CHUNK;
    int64_t group = n_cands > 0 ? 8 : 1;
    for (int64_t k = 0; k < n_cands; k++)
        if (cands[k] % 8) group = 1;
    double *P = work ? work : (double *)malloc((size_t)(n / group + 1) * sizeof(double));
    double *sums = (double *)malloc((size_t)chunks * 2 * sizeof(double));
    int *flags = (int *)calloc((size_t)chunks, sizeof(int));
    int64_t tasks = 0; /* score tasks: the segments of every candidate */
    for (int64_t k = 0; k < n_cands; k++) tasks += (n / cands[k] - 1 + SCORE_SEGMENT - 1) / SCORE_SEGMENT;
    int64_t *cost = (int64_t *)malloc((size_t)(3 * tasks + 1) * sizeof(int64_t));
    double *partial = (double *)malloc((size_t)(tasks + 1) * sizeof(double));
    int64_t *task_cand = cost + tasks + 1, *task_seg = task_cand + tasks;
    if (!P || !sums || !flags || !cost || !partial) {
        if (!work) free(P);
        free(sums), free(flags), free(cost), free(partial);
        return ERR_NOMEM;
    }
    period_ctx c = {g, P, n, group, sums, sums + chunks, flags, g[0] * g[0], 0.0, active_level() >= LEVEL_AVX2};
    parallel_for_cost(chunks, threads, period_logs_task, &c, 0);
    int all = 0;
    for (int64_t t = 0; t < chunks; t++) all |= flags[t];
    *nonzero = (all & 4) ? 1 : 0;
    int rc = (all & 1) ? ERR_NONFINITE : (all & 2) ? ERR_OVERFLOW : OK;
    if (rc == OK && !(all & 8)) /* every x equal: every score is exactly 0 (no rounding noise may pick a period) */
        for (int64_t k = 0; k < n_cands; k++) scores[k] = 0.0;
    else if (rc == OK && n_cands > 0) {
        double total = 0.0;
        for (int64_t t = 0; t < chunks; t++) total += sums[t];
        c.mean = total / (double)(n / group); /* per value: the logs of `group` elements */
        double start = 0.0;
        for (int64_t t = 0; t < chunks; t++) {
            const int64_t len = ((t + 1 < chunks) ? PERIOD_CHUNK : n - t * PERIOD_CHUNK) / group;
            c.chunk_start[t] = start;
            start += sums[t] - (double)len * c.mean;
        }
        P[0] = 0.0;
        parallel_for_cost(chunks, threads, period_prefix_task, &c, 0);
        int64_t t = 0;
        cost[0] = 0;
        for (int64_t k = 0; k < n_cands; k++) {
            const int64_t diffs = n / cands[k] - 1;
            for (int64_t seg = 0; seg * SCORE_SEGMENT < diffs; seg++, t++) {
                task_cand[t] = k;
                task_seg[t] = seg;
                cost[t + 1] = cost[t] + (diffs - seg * SCORE_SEGMENT < SCORE_SEGMENT ? diffs - seg * SCORE_SEGMENT
                                                                                   : SCORE_SEGMENT);
            }
        }
        score_ctx sc = {P, cands, task_cand, task_seg, partial, n, group};
        parallel_for_cost(t, threads, period_score_task, &sc, cost);
        for (int64_t k = 0, u = 0; k < n_cands; k++) {
            const int64_t diffs = n / cands[k] - 1;
            double total = 0.0;
            for (; u < t && task_cand[u] == k; u++) total += partial[u];
            scores[k] = total / (double)diffs;
        }
    }
    if (!work) free(P);
    free(sums), free(flags), free(cost), free(partial);
    return rc;
}
