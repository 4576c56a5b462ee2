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
 * Grouping (plan_classes): the candidates are split into classes, each with a group size G dividing all of its
 * periods: the multiples of 8 (G = 8), then the others by a greedy gcd (G >= 2; e.g. 11 for a 512 x 1408 weight).
 * Each class has its own prefix, of one value per G elements (the sum of their logs, taken as logs of products of
 * up to 12 scaled factors: see "grouped values" below), its own mean, and scores its candidates; the prefixes fit
 * in n + 1 doubles. Two classes of G = 8 and G <= 12 are paired: one read of g computes both (period_ctx.paired).
 * When a class would be G = 1, or grouping would not save work, one per-element prefix (one log per element)
 * serves every candidate. The scores are summed per range of a class's prefix (all its candidates
 * while that range is in the cache), without a division per block.
 *
 * ln: x = 2^e m with m in [sqrt(1/2), sqrt(2)), ln x = e ln2 + 2 atanh(s), s = (m - 1) / (m + 1), the atanh series
 * to z^10 (z = s^2 <= 0.0295: truncation below 1e-18), e ln2 in two parts (fdlibm's split). Every multiply-add is
 * spelled out as fma, so the scalar, AVX2 and AVX-512 paths round alike; error a few ulp.
 * The vector paths (AVX2, AVX-512) are in gefen_period_simd.c, included below the scalar functions they reproduce.
 */


/* Elements per task of the log and prefix passes (fixed: the chunk sums fix the summation order). */
#define PERIOD_CHUNK 65536

static const double LN2_HI = 6.93147180369123816490e-01, LN2_LO = 1.90821492927058770002e-10;
/* ln's reduction in integer arithmetic: adding LN_SHIFT to x's bits carries into the exponent exactly when x's
 * mantissa m (in [1, 2)) is above SQRT2 = 0x3ff6a09e667f3bcd (the double nearest sqrt(2), below it), and the
 * mantissa bits left plus LN_MID are m, or m / 2 after a carry (LN_MID = SQRT2 / 2 + 1 ulp, LN_SHIFT = 1.0 - LN_MID
 * as bit patterns): the m and e of "if (m > SQRT2) m /= 2, e += 1", without the compare and the select. */
static const uint64_t LN_SHIFT = 0x00095f619980c432ULL, LN_MID = 0x3fe6a09e667f3bceULL;

/* The atanh series' coefficients 1/21, 1/19, ..., 1/3, in Horner order (every path evaluates them alike). */
static const double ATANH_SERIES[10] = {1.0 / 21.0, 1.0 / 19.0, 1.0 / 17.0, 1.0 / 15.0, 1.0 / 13.0,
                                        1.0 / 11.0, 1.0 / 9.0,  1.0 / 7.0,  1.0 / 5.0,  1.0 / 3.0};

static inline double ln_positive(double x) { /* x > 0, finite, normal */
    uint64_t b;
    memcpy(&b, &x, 8);
    b += LN_SHIFT;
    const double e = (double)(int64_t)(b >> 52) - 1023.0;
    const uint64_t mb = (b & 0x000fffffffffffffULL) + LN_MID;
    double m;
    memcpy(&m, &mb, 8);
    double s = (m - 1.0) / (m + 1.0), z = s * s;
    double poly = ATANH_SERIES[0];
    for (int k = 1; k < 10; k++) poly = fma(poly, z, ATANH_SERIES[k]);
    double s2 = s + s;
    double lnm = fma(s2 * z, poly, s2); /* 2s + 2s z (1/3 + z/5 + ...) */
    return fma(e, LN2_HI, lnm + e * LN2_LO);
}

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

/* The per-element path (G = 1). Logs of elements [i0, i1) into out[i0 + 1 ..] and their sum: the whole groups of
 * 8 in 8 lanes (lane k takes the elements i0 + j with j % 8 == k, in order), the lanes added as sum8, then the rest
 * one by one (logs_tail). */
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

/* ------------------------------------------------------------------ grouped values
 * A class of candidates whose periods are all multiples of G >= 2 reads its prefix only at multiples of G, so it
 * keeps one value per group of G elements: the sum of their logs, taken as a sum of logs of products. The group
 * is cut into runs of at most PERIOD_RUN consecutive elements (runs = ceil(G / 12) runs of 12, the last one
 * shorter); each run's product of y'_k = (x_k + 1e-12) 2^-44 (exact: a power-of-two scaling of the float64 y_k)
 * has one log, and the value is l_0 + l_1 + ... in order. Every y_k is in [1e-12, FLT_MAX] (an x above FLT_MAX
 * is the overflow error, checked first), so y' is in (2^-84, 2^84) and a product of 12 in (2^-1008, 2^1008):
 * normal, no overflow or underflow. The value is ln(product of y) - 44 ln2 G, the same constant for every value
 * of the class, which the centring removes (the scores use differences of prefix values only); its rounding is
 * that of the per-element sum to a few ulp of the value. A run's product is (a0 a1)(a2 a3), a_k = the product
 * of its y'_{k + 4m} in order of m (a_k = 1 when there are none), which the AVX2 path computes four lanes wide
 * (the missing factors as 1, an exact multiply). */

#define PERIOD_RUN 12
/* Elements per buffered piece of the AVX2 grouped pass (whole runs; a multiple of 8, in the L1 cache). */
#define PERIOD_PIECE 2040
/* Most classes: the multiples of 8 and two others (more would cost as many passes over g as they save logs). */
#define PERIOD_MAX_CLASSES 3

typedef struct {
    int64_t group;  /* G: elements per value (1: per element, the logs of period_logs_task's per-element path) */
    int64_t runs;   /* runs per group, ceil(G / PERIOD_RUN) */
    int64_t values; /* n / G */
    int64_t per;    /* values per chunk (the last chunk may hold fewer) */
    int64_t chunks;
    int64_t first;  /* its first chunk's index among the chunks of all classes */
    double *prefix; /* (values + 1,) */
} period_class;

typedef struct {
    const float *g;
    int64_t n;
    period_class cls[PERIOD_MAX_CLASSES];
    int64_t n_classes;
    double *chunk_sum;   /* (chunks of all classes,) */
    double *chunk_start; /* (chunks of all classes,) prefix value before each chunk */
    int *flags;          /* (chunks of all classes,): 1 non-finite g, 2 g*g overflowed, 4 some g != 0, 8 some x != x0 */
    float x0;            /* g[0] * g[0] */
    double mean[PERIOD_MAX_CLASSES];
    int avx2, avx512;
    int paired; /* two classes, G = 8 and G <= PERIOD_RUN, on the same chunks of elements: a log task does both */
} period_ctx;

/* The class of chunk t (among the chunks of all classes) and the range [*v0, *v1) of its values that the chunk
 * holds. */
static int64_t chunk_class(const period_ctx *c, int64_t t, int64_t *v0, int64_t *v1) {
    int64_t k = 0;
    while (k + 1 < c->n_classes && t >= c->cls[k + 1].first) k++;
    const period_class *cl = &c->cls[k];
    *v0 = (t - cl->first) * cl->per;
    *v1 = *v0 + cl->per < cl->values ? *v0 + cl->per : cl->values;
    return k;
}

static inline void element_flags(float gi, float x, float x0, int *flags) {
    if (!(fabsf(gi) <= 3.4028234663852886e38f)) *flags |= 1;
    else if (!(x <= 3.4028234663852886e38f)) *flags |= 2;
    if (gi != 0.0f) *flags |= 4;
    if (x != x0) *flags |= 8;
}

static inline double scaled_y(float x) { return ((double)x + 1e-12) * 0x1p-44; }

/* (a0 a1)(a2 a3) of the len (1..PERIOD_RUN) factors y[0 .. len). */
static inline double run_product(const double *y, int64_t len) {
    double a[4] = {1.0, 1.0, 1.0, 1.0};
    for (int64_t i = 0; i < len; i++) a[i & 3] *= y[i];
    return (a[0] * a[1]) * (a[2] * a[3]);
}

/* The values of groups [j0, j1) of 8 elements into out[j + 1], one element at a time: the tail of the vector paths
 * of the G = 8 class (the same operations as groups_scalar for G = 8, one run). */
static void groups8_scalar(const float *g, double *out, int64_t j0, int64_t j1, float x0, int *flags) {
    double y[8];
    for (int64_t j = j0; j < j1; j++) {
        for (int k = 0; k < 8; k++) {
            const float gi = g[8 * j + k], x = gi * gi;
            element_flags(gi, x, x0, flags);
            y[k] = scaled_y(x);
        }
        out[j + 1] = ln_positive(run_product(y, 8));
    }
}

/* The values of groups [j0, j1) of class c into c->prefix[j + 1], one element at a time (the order of every path). */
static void groups_scalar(const float *g, const period_class *c, int64_t j0, int64_t j1, float x0, int *flags) {
    const int64_t G = c->group, runs = c->runs;
    double y[PERIOD_RUN];
    for (int64_t j = j0; j < j1; j++) {
        double v = 0.0;
        for (int64_t r = 0, e = j * G; r < runs; r++) {
            const int64_t len = r + 1 < runs ? PERIOD_RUN : G - PERIOD_RUN * (runs - 1);
            for (int64_t k = 0; k < len; k++) {
                const float gi = g[e + k], x = gi * gi;
                element_flags(gi, x, x0, flags);
                y[k] = scaled_y(x);
            }
            const double l = ln_positive(run_product(y, len));
            v = r ? v + l : l;
            e += len;
        }
        c->prefix[j + 1] = v;
    }
}

/* The sum of values [j0, j1) (at out[j + 1]): 4 lanes (lane k: the values j0 + 4m + k) added as (l0 + l1) +
 * (l2 + l3), then the last (j1 - j0) % 4 one by one. */
static double sum_values(const double *out, int64_t j0, int64_t j1) {
    double lanes[4] = {0};
    const int64_t full = j0 + ((j1 - j0) & ~(int64_t)3);
    for (int64_t j = j0; j < full; j++) lanes[(j - j0) & 3] += out[j + 1];
    double total = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    for (int64_t j = full; j < j1; j++) total += out[j + 1];
    return total;
}

static int64_t gcd64(int64_t a, int64_t b) {
    while (b) {
        const int64_t r = a % b;
        a = b;
        b = r;
    }
    return a;
}

#if GEFEN_X86
#include "gefen_period_simd.c" /* the AVX2 and AVX-512 paths of the functions above */
#endif

/* Values [j0, j1) of a grouped class (G >= 2) into its prefix; returns their sum, flags into *flags. */
static double class_values(const period_ctx *c, const period_class *cl, int64_t j0, int64_t j1, int *flags) {
    int done = 0;
#if GEFEN_X86
    if (c->avx512 && cl->group == 8) done = group8_avx512(c->g, cl->prefix, j0, j1, c->x0, flags);
    else if (c->avx512 && cl->runs == 1) done = groups1_avx512(c->g, cl, j0, j1, c->x0, flags);
    else if (c->avx2)
        done = cl->group == 8 ? group8_avx2(c->g, cl->prefix, j0, j1, c->x0, flags)
                              : groups_avx2(c->g, cl, j0, j1, c->x0, flags);
    if (!done) *flags = 0; /* redone in scalar, which tells a non-finite value from an overflow */
#endif
    if (!done) groups_scalar(c->g, cl, j0, j1, c->x0, flags);
#if GEFEN_X86
    if (c->avx2) return sum_values_avx2(cl->prefix, j0, j1);
#endif
    return sum_values(cl->prefix, j0, j1);
}

/* Chunk t of the paired classes (period_ctx.paired): both classes' chunk t, their sums and flags (all of them on
 * class 0's chunk). One read of g on the AVX2 path; each class on its own otherwise (the same values). */
static void paired_task(const period_ctx *c, int64_t t) {
    const period_class *a = &c->cls[0], *b = &c->cls[1];
    const int64_t a0 = t * a->per, a1 = a0 + a->per < a->values ? a0 + a->per : a->values;
    const int64_t b0 = t * b->per, b1 = b0 + b->per < b->values ? b0 + b->per : b->values;
    int fa = 0, fb = 0;
#if GEFEN_X86
    if (c->avx2 && !c->avx512 && pair_avx2(c->g, a, b, a0, a1, b0, c->x0, &fa)) {
        c->chunk_sum[a->first + t] = sum_values_avx2(a->prefix, a0, a1);
        c->chunk_sum[b->first + t] = sum_values_avx2(b->prefix, b0, b1);
        c->flags[a->first + t] = fa;
        c->flags[b->first + t] = 0;
        return;
    }
    fa = 0;
#endif
    c->chunk_sum[a->first + t] = class_values(c, a, a0, a1, &fa);
    c->chunk_sum[b->first + t] = class_values(c, b, b0, b1, &fb);
    c->flags[a->first + t] = fa;
    c->flags[b->first + t] = fb;
}

/* Log task t: chunk t of all classes' chunks (its class's values, or per-element logs, into the prefix, their sum,
 * flags), or of the paired classes. */
static void period_logs_task(const void *ctx_, int64_t t, int64_t thread) {
    (void)thread;
    const period_ctx *c = (const period_ctx *)ctx_;
    if (c->paired) {
        paired_task(c, t);
        return;
    }
    int64_t j0, j1;
    const period_class *cl = &c->cls[chunk_class(c, t, &j0, &j1)];
    int flags = 0;
    if (cl->group == 1) {
#if GEFEN_X86
        if (c->avx2 && logs_avx2(c->g, cl->prefix, j0, j1, c->x0, &c->chunk_sum[t], &flags)) {
            c->flags[t] = flags;
            return;
        }
        flags = 0;
#endif
        c->chunk_sum[t] = logs_scalar(c->g, cl->prefix, j0, j1, c->x0, &flags);
        c->flags[t] = flags;
        return;
    }
    c->chunk_sum[t] = class_values(c, cl, j0, j1, &flags);
    c->flags[t] = flags;
}


/* P[i + 1] = P[i] + (v_i - mean) over one chunk of one class, four at a time: within a group of 4 the partial
 * sums are (d0, d0 + d1, (d1 + d2) + d0, (d2 + d3) + (d0 + d1)), each added to the running value (the AVX2 path's
 * order, replayed by the scalar path). */
static void period_prefix_task(const void *ctx_, int64_t t, int64_t thread) {
    (void)thread;
    const period_ctx *c = (const period_ctx *)ctx_;
    int64_t i0, i1;
    const int64_t k = chunk_class(c, t, &i0, &i1);
    const period_class *cl = &c->cls[k];
    double *P = cl->prefix, run = c->chunk_start[t];
    const double mean = c->mean[k];
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

/* Prefix values per task of the scores: every candidate of a class is scored over one range of its prefix while
 * that range is in the cache (one pass over the prefix, not one per candidate). The ranges are fixed, so each
 * score's sum has one order (its ranges' partial sums, each in order, added in order) whatever the thread count. */
#define SCORE_RANGE 8192

typedef struct {
    const period_ctx *c;
    const int64_t *cands, *cand_class, *part_at; /* (n_cands,): class, index of the first of its partial sums */
    const int64_t *task_class, *task_range;      /* (tasks,) */
    double *partial;
    int64_t n_cands;
} score_ctx;

/* The differences b (1 <= b < B) with b s in [v0, v1) of a candidate of stride s (p / G in its class's prefix P):
 * the sum of |D_b - D_{b-1}|, D_b = P[(b + 1) s] - P[b s] (p times block b's mean), in 4 lanes (lane k: the b with
 * (b - b0) % 4 == k) added as (l0 + l1) + (l2 + l3), then the last ones one by one. */
static double score_range(const double *P, int64_t s, int64_t B, int64_t v0, int64_t v1) {
    int64_t b = (v0 + s - 1) / s;
    if (b < 1) b = 1;
    int64_t b1 = (v1 + s - 1) / s;
    if (b1 > B) b1 = B;
    if (b >= b1) return 0.0;
    double at = P[b * s], prev = at - P[(b - 1) * s];
    double l0 = 0.0, l1 = 0.0, l2 = 0.0, l3 = 0.0;
    for (; b + 4 <= b1; b += 4) {
        const double p1 = P[(b + 1) * s], p2 = P[(b + 2) * s], p3 = P[(b + 3) * s], p4 = P[(b + 4) * s];
        const double d0 = p1 - at, d1 = p2 - p1, d2 = p3 - p2, d3 = p4 - p3;
        l0 += fabs(d0 - prev);
        l1 += fabs(d1 - d0);
        l2 += fabs(d2 - d1);
        l3 += fabs(d3 - d2);
        prev = d3;
        at = p4;
    }
    double total = (l0 + l1) + (l2 + l3);
    for (; b < b1; b++) {
        const double next = P[(b + 1) * s], d = next - at;
        total += fabs(d - prev);
        prev = d;
        at = next;
    }
    return total;
}


/* Range u of class k: every candidate of the class, its partial sum (no division; the same sums on every path). */
static void period_score_task(const void *ctx_, int64_t t, int64_t thread) {
    (void)thread;
    const score_ctx *sc = (const score_ctx *)ctx_;
    const int64_t k = sc->task_class[t], u = sc->task_range[t];
    const period_class *cl = &sc->c->cls[k];
    const int64_t v0 = u * SCORE_RANGE, v1 = v0 + SCORE_RANGE < cl->values ? v0 + SCORE_RANGE : cl->values;
    for (int64_t i = 0; i < sc->n_cands; i++) {
        if (sc->cand_class[i] != k) continue;
        const int64_t s = sc->cands[i] / cl->group, B = sc->c->n / sc->cands[i];
        double *out = &sc->partial[sc->part_at[i] + u];
#if GEFEN_X86
        if (s == 1 && sc->c->avx2) {
            *out = score_range1_avx2(cl->prefix, B, v0, v1);
            continue;
        }
#endif
        *out = score_range(cl->prefix, s, B, v0, v1);
    }
}

/* The classes of the candidates into groups[] (returns their count) and cand_class[]: the multiples of 8 (G = 8),
 * then, greedily from the smallest candidate left, G = that candidate, and each other candidate left (in the
 * caller's order) whose gcd with G is >= 2 joins, G becoming that gcd. One class of G = 1 (per element, every
 * candidate) instead when that leaves a class of G = 1, more than PERIOD_MAX_CLASSES classes, prefixes beyond
 * n + 1 values, or more passes than the logs they save
 * (sum over classes of 1/4 + 1/G at least 1, in logs per element). */
static int64_t plan_classes(int64_t n, const int64_t *cands, int64_t n_cands, int64_t *cand_class, int64_t *groups) {
    int64_t count = 0, left = 0;
    for (int64_t k = 0; k < n_cands; k++) {
        cand_class[k] = cands[k] % 8 == 0 ? 0 : -1;
        left += cand_class[k] < 0;
    }
    if (left < n_cands) groups[count++] = 8;
    while (left > 0) {
        int64_t first = -1;
        for (int64_t k = 0; k < n_cands; k++)
            if (cand_class[k] < 0 && (first < 0 || cands[k] < cands[first])) first = k;
        int64_t G = cands[first];
        if (G < 2 || count == PERIOD_MAX_CLASSES) goto per_element;
        cand_class[first] = count;
        left--;
        for (int64_t k = 0; k < n_cands; k++) /* in the caller's order (ascending from Python) */
            if (cand_class[k] < 0 && gcd64(G, cands[k]) >= 2) {
                G = gcd64(G, cands[k]);
                cand_class[k] = count;
                left--;
            }
        groups[count++] = G;
    }
    {
        int64_t values = 0;
        double passes = 0.0;
        for (int64_t k = 0; k < count; k++) {
            values += n / groups[k] + 1;
            passes += 0.25 + 1.0 / (double)groups[k];
        }
        if (count > 0 && values <= n + 1 && passes < 1.0) return count;
    }
per_element:
    for (int64_t k = 0; k < n_cands; k++) cand_class[k] = 0;
    groups[0] = 1;
    return 1;
}

/* Between the logs and the prefixes (thread 0 alone): the flags decide; then the classes' means and their chunks'
 * starting prefix values. When no score is to be computed (an error, every x equal, no candidate) the later loops
 * get no tasks. */
typedef struct {
    period_ctx *c;
    int64_t chunks, n_cands;
    double *scores;
    int64_t *nonzero;
    int rc;
    loop_phase *phases; /* [1]: prefixes, [2]: scores */
} period_between;

static void period_after_logs(void *state) {
    period_between *b = (period_between *)state;
    period_ctx *c = b->c;
    int all = 0;
    for (int64_t t = 0; t < b->chunks; t++) all |= c->flags[t];
    *b->nonzero = (all & 4) ? 1 : 0;
    b->rc = (all & 1) ? ERR_NONFINITE : (all & 2) ? ERR_OVERFLOW : OK;
    if (b->rc == OK && !(all & 8)) /* every x equal: every score is exactly 0 (no rounding noise may pick a period) */
        for (int64_t k = 0; k < b->n_cands; k++) b->scores[k] = 0.0;
    if (b->rc != OK || !(all & 8) || b->n_cands == 0) {
        b->phases[1].tasks = 0;
        b->phases[2].tasks = 0;
        return;
    }
    for (int64_t k = 0; k < c->n_classes; k++) {
        period_class *cl = &c->cls[k];
        double total = 0.0;
        for (int64_t t = cl->first; t < cl->first + cl->chunks; t++) total += c->chunk_sum[t];
        c->mean[k] = total / (double)cl->values; /* per value: the logs of G elements (less 44 G ln2) */
        double start = 0.0;
        for (int64_t u = 0; u < cl->chunks; u++) {
            const int64_t len = u + 1 < cl->chunks ? cl->per : cl->values - u * cl->per;
            c->chunk_start[cl->first + u] = start;
            start += c->chunk_sum[cl->first + u] - (double)len * c->mean[k];
        }
        cl->prefix[0] = 0.0;
    }
}

/* The scores of n_cands candidate periods (each dividing n with n / p >= 2) of the gradient g (n fp32 values) into
 * scores[0..n_cands) (all exactly 0 when every g_i * g_i is the same value). *nonzero is set to 1 when some
 * g_i != 0, else 0. work: n + 1 doubles of scratch (the classes' prefixes never need more, see plan_classes), or
 * 0 (then allocated here: a caller that searches many tensors passes one buffer and saves its page faults).
 * Returns OK, ERR_ARGS, ERR_NOMEM, ERR_NONFINITE (a NaN or an infinity in g) or ERR_OVERFLOW (some g_i * g_i
 * overflows fp32: the caller uses the reference); scores are written only on OK. */
int gefen_period_scores(const float *g, int64_t n, const int64_t *cands, int64_t n_cands, double *scores,
                        int64_t *nonzero, double *work, int64_t threads) {
    if (!g || n <= 0 || n_cands < 0 || (n_cands > 0 && (!cands || !scores)) || !nonzero) return ERR_ARGS;
    for (int64_t k = 0; k < n_cands; k++)
        if (cands[k] < 1 || n % cands[k] != 0 || n / cands[k] < 2) return ERR_ARGS;
    if (threads < 1 || n < PARALLEL_MIN_ELEMENTS) threads = 1;
    period_ctx c;
    memset(&c, 0, sizeof c);
    c.g = g;
    c.n = n;
    c.x0 = g[0] * g[0];
    c.avx2 = active_level() >= LEVEL_AVX2;
    c.avx512 = active_level() >= LEVEL_AVX512;
    int64_t *cand_class = (int64_t *)malloc((size_t)(n_cands + 1) * sizeof(int64_t));
    if (!cand_class) return ERR_NOMEM;
    int64_t groups[PERIOD_MAX_CLASSES], values = 0, chunks = 0;
    c.n_classes = plan_classes(n, cands, n_cands, cand_class, groups);
    /* Paired: the multiples of 8 and one class of one run per group (e.g. 11, 22, 44 of a 512 x 1408 weight) take
     * their values from one read of g (pair_avx2: the squares, checks and scaling done once), in chunks of the same
     * elements: lcm(8, G) times about PERIOD_CHUNK / lcm elements (n is a multiple of both G). Zen 1, that weight's
     * scores: 2.42 -> 1.89 ms on one thread, 1.21 -> 1.02 ms on two. */
    c.paired = c.n_classes == 2 && groups[0] == 8 && groups[1] <= PERIOD_RUN;
    const int64_t lcm = c.paired ? 8 * groups[1] / gcd64(8, groups[1]) : 1;
    const int64_t span = c.paired ? lcm * (PERIOD_CHUNK / lcm > 0 ? PERIOD_CHUNK / lcm : 1) : 0;
    for (int64_t k = 0; k < c.n_classes; k++) {
        period_class *cl = &c.cls[k];
        cl->group = groups[k];
        cl->runs = (cl->group + PERIOD_RUN - 1) / PERIOD_RUN;
        cl->values = n / cl->group;
        if (c.paired) { /* the chunks of span elements (the last one shorter, whole groups of both classes) */
            cl->per = span / cl->group;
            cl->chunks = (n + span - 1) / span;
        } else { /* about PERIOD_CHUNK elements per chunk, the values spread evenly (a function of n and G) */
            const int64_t most = PERIOD_CHUNK / cl->group > 0 ? PERIOD_CHUNK / cl->group : 1;
            cl->chunks = (cl->values + most - 1) / most;
            cl->per = (cl->values + cl->chunks - 1) / cl->chunks;
            cl->chunks = (cl->values + cl->per - 1) / cl->per;
        }
        cl->first = chunks;
        chunks += cl->chunks;
        values += cl->values + 1;
    }
    double *P = work ? work : (double *)malloc((size_t)values * sizeof(double));
    double *sums = (double *)malloc((size_t)chunks * 2 * sizeof(double));
    int *flags = (int *)calloc((size_t)chunks, sizeof(int));
    int64_t tasks = 0, parts = 0; /* score tasks: the ranges of every class; partial sums: those of every candidate */
    for (int64_t k = 0; k < c.n_classes; k++) tasks += (c.cls[k].values + SCORE_RANGE - 1) / SCORE_RANGE;
    for (int64_t i = 0; i < n_cands; i++) parts += (c.cls[cand_class[i]].values + SCORE_RANGE - 1) / SCORE_RANGE;
    int64_t *cost = (int64_t *)malloc((size_t)(3 * tasks + chunks + n_cands + 2) * sizeof(int64_t));
    double *partial = (double *)malloc((size_t)(parts + 1) * sizeof(double));
    int64_t *task_class = cost + tasks + 1, *task_range = task_class + tasks, *chunk_cost = task_range + tasks;
    int64_t *part_at = chunk_cost + chunks + 1;
    if (!P || !sums || !flags || !cost || !partial) {
        if (!work) free(P);
        free(sums), free(flags), free(cost), free(partial), free(cand_class);
        return ERR_NOMEM;
    }
    for (int64_t k = 0, at = 0; k < c.n_classes; k++) {
        c.cls[k].prefix = P + at;
        at += c.cls[k].values + 1;
    }
    c.chunk_sum = sums;
    c.chunk_start = sums + chunks;
    c.flags = flags;
    /* a chunk's cost: its elements, plus its logs at about 4 elements' work each; a paired task does chunk u of
     * both classes */
    const int64_t log_tasks = c.paired ? c.cls[0].chunks : chunks;
    for (int64_t t = 0; t <= chunks; t++) chunk_cost[t] = 0;
    for (int64_t k = 0, t = 0; k < c.n_classes; k++)
        for (int64_t u = 0; u < c.cls[k].chunks; u++, t++) {
            const period_class *cl = &c.cls[k];
            const int64_t len = (u + 1 < cl->chunks ? cl->per : cl->values - u * cl->per);
            chunk_cost[(c.paired ? u : t) + 1] += len * cl->group + 4 * len * cl->runs;
        }
    for (int64_t t = 0; t < log_tasks; t++) chunk_cost[t + 1] += chunk_cost[t]; /* cumulative */
    /* the score tasks: every range of every class's prefix (their costs: the differences they take) */
    for (int64_t i = 0, at = 0; i < n_cands; i++) {
        part_at[i] = at;
        at += (c.cls[cand_class[i]].values + SCORE_RANGE - 1) / SCORE_RANGE;
    }
    int64_t t = 0;
    cost[0] = 0;
    for (int64_t k = 0; k < c.n_classes; k++) {
        const period_class *cl = &c.cls[k];
        double per_value = 0.0; /* differences per prefix value, over the class's candidates */
        for (int64_t i = 0; i < n_cands; i++)
            if (cand_class[i] == k) per_value += (double)cl->group / (double)cands[i];
        for (int64_t u = 0; u * SCORE_RANGE < cl->values; u++, t++) {
            task_class[t] = k;
            task_range[t] = u;
            cost[t + 1] = cost[t] + 1 + (int64_t)(per_value * SCORE_RANGE);
        }
    }
    /* one parallel region: the logs, then (between, on one thread: the flags, the means and the chunk starts)
     * the prefixes, then the scores */
    score_ctx sc = {&c, cands, cand_class, part_at, task_class, task_range, partial, n_cands};
    loop_phase phases[3] = {{period_logs_task, &c, log_tasks, chunk_cost, 0, 0},
                            {period_prefix_task, &c, chunks, 0, 0, 0},
                            {period_score_task, &sc, t, cost, 0, 0}};
    period_between between = {&c, chunks, n_cands, scores, nonzero, OK, phases};
    phases[1].before = period_after_logs;
    phases[1].state = &between;
    parallel_phases(phases, 3, threads);
    const int rc = between.rc;
    if (rc == OK && phases[2].tasks > 0)
        for (int64_t i = 0; i < n_cands; i++) {
            const int64_t ranges = (c.cls[cand_class[i]].values + SCORE_RANGE - 1) / SCORE_RANGE;
            double total = 0.0;
            for (int64_t u = 0; u < ranges; u++) total += partial[part_at[i] + u];
            /* the mean over the n / p - 1 differences of |D_b - D_{b-1}| / p: one division, by p (n / p - 1) */
            scores[i] = total / (double)(cands[i] * (n / cands[i] - 1));
        }
    if (!work) free(P);
    free(sums), free(flags), free(cost), free(partial), free(cand_class);
    return rc;
}
