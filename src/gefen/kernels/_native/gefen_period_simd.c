/*
 * The x86 vector paths of the period search (gefen_period.c, which includes this file after its scalar programme
 * and defines every value these paths reproduce): AVX2 (LEVEL_AVX2 and up) and AVX-512 (LEVEL_AVX512 and up).
 * Each function gives the bits of the scalar function it names, whatever the level: the same operations in the same
 * order, only more lanes at a time (the exact rewrites are stated where they are used).
 */

/* ------------------------------------------------------------------ per-element logs (G = 1), AVX2 */
__attribute__((target("avx2,fma"))) static inline __m256d ln_positive4(__m256d x) {
    const __m256i bits = _mm256_add_epi64(_mm256_castpd_si256(x), _mm256_set1_epi64x((int64_t)LN_SHIFT));
    const __m256i biased = _mm256_or_si256(_mm256_srli_epi64(bits, 52), _mm256_set1_epi64x(0x4330000000000000LL));
    /* (2^52 + the biased exponent) - (2^52 + 1023), exactly */
    const __m256d e = _mm256_sub_pd(_mm256_castsi256_pd(biased), _mm256_set1_pd(4503599627371519.0));
    const __m256d m = _mm256_castsi256_pd(_mm256_add_epi64(
        _mm256_and_si256(bits, _mm256_set1_epi64x(0x000fffffffffffffLL)), _mm256_set1_epi64x((int64_t)LN_MID)));
    const __m256d one = _mm256_set1_pd(1.0);
    const __m256d s = _mm256_div_pd(_mm256_sub_pd(m, one), _mm256_add_pd(m, one)), z = _mm256_mul_pd(s, s);
    __m256d poly = _mm256_set1_pd(ATANH_SERIES[0]);
    for (int k = 1; k < 10; k++) poly = _mm256_fmadd_pd(poly, z, _mm256_set1_pd(ATANH_SERIES[k]));
    const __m256d s2 = _mm256_add_pd(s, s);
    const __m256d lnm = _mm256_fmadd_pd(_mm256_mul_pd(s2, z), poly, s2);
    return _mm256_fmadd_pd(e, _mm256_set1_pd(LN2_HI), _mm256_add_pd(lnm, _mm256_mul_pd(e, _mm256_set1_pd(LN2_LO))));
}

/* element_flags for eight elements gi (squares x), accumulated per lane: *bad gets NaN, infinity or an overflowing
 * square (x is g * g, never negative, so "not x <= max" is all three, a NaN of either sign included), *bits the OR
 * of the gi themselves (some g != 0 iff a lane has a magnitude bit: flags_done), *varies x != x0. */
__attribute__((target("avx2"))) static inline void flags8(__m256 gi, __m256 x, __m256 vx0, __m256 *bad, __m256 *bits,
                                                          __m256 *varies) {
    *bad = _mm256_or_ps(*bad, _mm256_cmp_ps(x, _mm256_set1_ps(3.4028234663852886e38f), _CMP_NLE_UQ));
    *bits = _mm256_or_ps(*bits, gi);
    *varies = _mm256_or_ps(*varies, _mm256_cmp_ps(x, vx0, _CMP_NEQ_UQ));
}

/* The flags of flags8's accumulators into *flags (4: some g != 0, 8: some x != x0); returns 0 when one was bad. */
__attribute__((target("avx2"))) static inline int flags_done(__m256 bad, __m256 bits, __m256 varies, int *flags) {
    if (_mm256_movemask_ps(bad)) return 0;
    if (!_mm256_testz_si256(_mm256_castps_si256(bits), _mm256_set1_epi32(0x7fffffff))) *flags |= 4;
    if (_mm256_movemask_ps(varies)) *flags |= 8;
    return 1;
}

/* logs_scalar's groups of 8 of [i0, i1) (the same lanes and order); returns 0 when a value is not finite or
 * squares to an overflow (nothing summed: the caller redoes the chunk in scalar to tell which), else the sum. */
__attribute__((target("avx2,fma"))) static int logs_avx2(const float *g, double *out, int64_t i0, int64_t i1,
                                                         float x0, double *sum, int *flags) {
    const __m256d delta = _mm256_set1_pd(1e-12);
    __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
    __m256 bad = _mm256_setzero_ps(), bits = _mm256_setzero_ps(), varies = _mm256_setzero_ps();
    const __m256 vx0 = _mm256_set1_ps(x0);
    int64_t i = i0;
    for (; i + 8 <= i1; i += 8) {
        const __m256 gi = _mm256_loadu_ps(g + i), x = _mm256_mul_ps(gi, gi);
        flags8(gi, x, vx0, &bad, &bits, &varies);
        const __m256d l0 = ln_positive4(_mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(x)), delta));
        const __m256d l1 = ln_positive4(_mm256_add_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)), delta));
        _mm256_storeu_pd(out + i + 1, l0);
        _mm256_storeu_pd(out + i + 5, l1);
        acc0 = _mm256_add_pd(acc0, l0);
        acc1 = _mm256_add_pd(acc1, l1);
    }
    if (!flags_done(bad, bits, varies, flags)) return 0;
    double lanes[8];
    _mm256_storeu_pd(lanes, acc0);
    _mm256_storeu_pd(lanes + 4, acc1);
    double total = sum8(lanes);
    logs_tail(g, out, i, i1, x0, &total, flags);
    *sum = total;
    return 1;
}

/* ------------------------------------------------------------------ grouped values, AVX2 */
/* sum_values in one 4-lane register (the same lanes, the same order). */
__attribute__((target("avx2"))) static double sum_values_avx2(const double *out, int64_t j0, int64_t j1) {
    __m256d acc = _mm256_setzero_pd();
    int64_t j = j0;
    for (; j + 4 <= j1; j += 4) acc = _mm256_add_pd(acc, _mm256_loadu_pd(out + j + 1));
    double lanes[4];
    _mm256_storeu_pd(lanes, acc);
    double total = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    for (; j < j1; j++) total += out[j + 1];
    return total;
}

/* y' of the 8 elements at g as two vectors (elements 0-3, 4-7), with flags8's tests. y' = fma(x, 2^-44, 1e-12 2^-44)
 * equals scaled_y's (x + 1e-12) 2^-44 (the AVX-512 path's rewrite: scaling by a power of two commutes with rounding
 * while nothing is subnormal, and x + 1e-12 >= 1e-12). */
__attribute__((target("avx2,fma"))) static inline void scaled_y8(const float *g, __m256 vx0, __m256 *bad,
                                                                 __m256 *bits, __m256 *varies, __m256d *lo,
                                                                 __m256d *hi) {
    const __m256d scale = _mm256_set1_pd(0x1p-44), delta = _mm256_set1_pd(1e-12 * 0x1p-44);
    const __m256 gi = _mm256_loadu_ps(g), x = _mm256_mul_ps(gi, gi);
    flags8(gi, x, vx0, bad, bits, varies);
    *lo = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(x)), scale, delta);
    *hi = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)), scale, delta);
}

/* (p(a), p(b), p(c), p(d)) of four runs' lanes a..d, p(v) = (v0 v1)(v2 v3) (run_product's last step). */
__attribute__((target("avx2,fma"))) static inline __m256d run_products4(__m256d a, __m256d b, __m256d c, __m256d d) {
    /* (a0 a1, b0 b1, a2 a3, b2 b3) and (c0 c1, d0 d1, c2 c3, d2 d3) */
    const __m256d ab = _mm256_mul_pd(_mm256_unpacklo_pd(a, b), _mm256_unpackhi_pd(a, b));
    const __m256d cd = _mm256_mul_pd(_mm256_unpacklo_pd(c, d), _mm256_unpackhi_pd(c, d));
    return _mm256_mul_pd(_mm256_permute2f128_pd(ab, cd, 0x20), _mm256_permute2f128_pd(ab, cd, 0x31));
}

/* out[i] = ln(in[i]) for i < m (in place allowed): four at a time, the last m % 4 in scalar (the same values).
 * A pass of its own: the long dependency chain of each log overlaps with the next ones only in a short loop. */
__attribute__((target("avx2,fma"))) static void ln_array_avx2(const double *in, double *out, int64_t m) {
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) _mm256_storeu_pd(out + i, ln_positive4(_mm256_loadu_pd(in + i)));
    for (; i < m; i++) out[i] = ln_positive(in[i]);
}

/* Groups of 8 straight from g (one run per group: lane k of a group is y'_k y'_{k + 4}): the products of up to
 * 64 groups, four per iteration, into out, then their logs in place; the last (j1 - j0) % 4 groups in scalar.
 * Returns 0 (values unusable) when a value is not finite or squares to an overflow, else 1. */
__attribute__((target("avx2,fma"))) static int group8_avx2(const float *g, double *out, int64_t j0, int64_t j1,
                                                           float x0, int *flags) {
    const __m256 vx0 = _mm256_set1_ps(x0);
    __m256 bad = _mm256_setzero_ps(), bits = _mm256_setzero_ps(), varies = _mm256_setzero_ps();
    int64_t j = j0;
    while (j + 4 <= j1) { /* batches of up to 64 groups: their products into out, then their logs in place */
        const int64_t batch_end = j + 64 <= j1 ? j + 64 : j + ((j1 - j) & ~(int64_t)3), start = j;
        for (; j < batch_end; j += 4) {
            __m256d lanes[4];
            for (int k = 0; k < 4; k++) {
                __m256d lo, hi;
                scaled_y8(g + 8 * (j + k), vx0, &bad, &bits, &varies, &lo, &hi);
                lanes[k] = _mm256_mul_pd(lo, hi);
            }
            _mm256_storeu_pd(out + j + 1, run_products4(lanes[0], lanes[1], lanes[2], lanes[3]));
        }
        ln_array_avx2(out + start + 1, out + start + 1, batch_end - start);
    }
    if (!flags_done(bad, bits, varies, flags)) return 0;
    groups8_scalar(g, out, j, j1, x0, flags);
    return !(*flags & 3);
}

/* y'[i] of the len elements at g into y, then 16 ones (run_lanes reads 12 from the last run's start): squared,
 * checked (flags8) and scaled 8 at a time, the last len % 8 in scalar (element_flags into *flags). */
__attribute__((target("avx2,fma"))) static void piece_y_avx2(const float *g, int64_t len, double *y, float x0,
                                                             __m256 vx0, __m256 *bad, __m256 *bits, __m256 *varies,
                                                             int *flags) {
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) {
        __m256d lo, hi;
        scaled_y8(g + i, vx0, bad, bits, varies, &lo, &hi);
        _mm256_storeu_pd(y + i, lo);
        _mm256_storeu_pd(y + i + 4, hi);
    }
    for (; i < len; i++) {
        const float gi = g[i], x = gi * gi;
        element_flags(gi, x, x0, flags);
        y[i] = scaled_y(x);
    }
    for (int64_t k = 0; k < 16; k++) y[len + k] = 1.0;
}

/* Lanes 0..3 of one run of len (1..PERIOD_RUN) factors at y: a_k (run_product), missing factors as 1. Reads
 * y[0 .. 12) whatever len. */
__attribute__((target("avx2,fma"))) static inline __m256d run_lanes(const double *y, int64_t len) {
    const __m256d one = _mm256_set1_pd(1.0);
    const __m256i lane = _mm256_setr_epi64x(0, 1, 2, 3);
    __m256d v = _mm256_loadu_pd(y);
    if (len < 4) v = _mm256_blendv_pd(one, v, _mm256_castsi256_pd(_mm256_cmpgt_epi64(_mm256_set1_epi64x(len), lane)));
    if (len > 4) {
        __m256d w = _mm256_loadu_pd(y + 4);
        if (len < 8)
            w = _mm256_blendv_pd(one, w, _mm256_castsi256_pd(_mm256_cmpgt_epi64(_mm256_set1_epi64x(len - 4), lane)));
        v = _mm256_mul_pd(v, w);
    }
    if (len > 8) {
        __m256d w = _mm256_loadu_pd(y + 8);
        if (len < 12)
            w = _mm256_blendv_pd(one, w, _mm256_castsi256_pd(_mm256_cmpgt_epi64(_mm256_set1_epi64x(len - 8), lane)));
        v = _mm256_mul_pd(v, w);
    }
    return v;
}

/* groups_scalar for any G >= 2: pieces of whole runs (at most PERIOD_PIECE elements) are squared, checked and
 * scaled 8 at a time into a buffer, then their runs' products taken four runs at a time (the last runs of a
 * piece in scalar), then their logs (ln_array_avx2), then the values (each group's logs added in order).
 * Returns 0 (values unusable) when a value is not finite or squares to an overflow, else 1. */
__attribute__((target("avx2,fma"))) static int groups_avx2(const float *g, const period_class *c, int64_t j0,
                                                           int64_t j1, float x0, int *flags) {
    double y[PERIOD_PIECE + 16]; /* + 16: run_lanes reads 12 from the last run's start */
    double prod[PERIOD_PIECE];   /* the runs' products, then their logs */
    const int64_t G = c->group, runs = c->runs, last = G - PERIOD_RUN * (runs - 1);
    double *out = c->prefix;
    const __m256 vx0 = _mm256_set1_ps(x0);
    __m256 bad = _mm256_setzero_ps(), bits = _mm256_setzero_ps(), varies = _mm256_setzero_ps();
    int64_t r = j0 * runs, q = 0, j = j0, e = j0 * G; /* next run: its index, its place in group j, its start */
    const int64_t r_end = j1 * runs;
    double cur = 0.0; /* group j's value so far */
    while (r < r_end) {
        int64_t count = 0, len = 0; /* runs and elements of this piece */
        for (int64_t qq = q; r + count < r_end; count++) {
            const int64_t l = qq + 1 < runs ? PERIOD_RUN : last;
            if (len + l > PERIOD_PIECE) break;
            len += l;
            qq = qq + 1 == runs ? 0 : qq + 1;
        }
        piece_y_avx2(g + e, len, y, x0, vx0, &bad, &bits, &varies, flags);
        /* the runs' products (four at a time, the rest in scalar: the same values), then their logs */
        int64_t k = 0, off = 0, qk = q;
        for (; k + 4 <= count; k += 4) {
            __m256d lanes[4];
            for (int m = 0; m < 4; m++) {
                const int64_t l = qk + 1 < runs ? PERIOD_RUN : last;
                lanes[m] = run_lanes(y + off, l);
                off += l;
                qk = qk + 1 == runs ? 0 : qk + 1;
            }
            _mm256_storeu_pd(prod + k, run_products4(lanes[0], lanes[1], lanes[2], lanes[3]));
        }
        for (; k < count; k++) {
            const int64_t l = qk + 1 < runs ? PERIOD_RUN : last;
            prod[k] = run_product(y + off, l);
            off += l;
            qk = qk + 1 == runs ? 0 : qk + 1;
        }
        if (runs == 1) { /* one run per group: the logs are the values */
            ln_array_avx2(prod, out + j + 1, count);
            j += count;
        } else {
            ln_array_avx2(prod, prod, count);
            for (k = 0; k < count; k++) {
                cur = q ? cur + prod[k] : prod[k];
                if (q + 1 == runs) {
                    out[++j] = cur;
                    q = 0;
                } else {
                    q++;
                }
            }
        }
        r += count;
        e += len;
    }
    if (!flags_done(bad, bits, varies, flags)) return 0;
    return !(*flags & 3);
}

/* The paired classes of one chunk in one read of g (see period_ctx.paired): class a (G = 8) values [a0, a1) and
 * class b (G = b->group, one run per group) values [b0, b1) over the same elements, a0 * 8 = b0 * G to a1 * 8 =
 * b1 * G. Per piece of whole groups of both (a multiple of lcm(8, G) elements, at most PERIOD_PIECE): y' once
 * (squared, checked and scaled 8 at a time), then class a's products (group8_avx2's lanes y'_k y'_{k+4}) and
 * class b's (groups_avx2's run_lanes), four groups at a time with the rest in scalar, and their logs: the values
 * of group8_avx2 and groups_avx2, bit for bit. Returns 0 (values unusable) when a value is not finite or squares
 * to an overflow, else 1 (flags 4 and 8 set in *flags). */
__attribute__((target("avx2,fma"))) static int pair_avx2(const float *g, const period_class *a, const period_class *b,
                                                         int64_t a0, int64_t a1, int64_t b0, float x0, int *flags) {
    double y[PERIOD_PIECE + 16]; /* + 16: run_lanes reads 12 from the last group's start */
    double prod[PERIOD_PIECE];
    const int64_t G = b->group, lcm = 8 * G / gcd64(8, G), piece = PERIOD_PIECE / lcm * lcm;
    const __m256 vx0 = _mm256_set1_ps(x0);
    __m256 bad = _mm256_setzero_ps(), bits = _mm256_setzero_ps(), varies = _mm256_setzero_ps();
    for (int64_t e = 8 * a0, e1 = 8 * a1, ja = a0, jb = b0; e < e1;) {
        const int64_t len = e1 - e < piece ? e1 - e : piece, na = len / 8, nb = len / G;
        piece_y_avx2(g + e, len, y, x0, vx0, &bad, &bits, &varies, flags); /* len: a multiple of 8 */
        double *out = a->prefix + ja + 1;
        int64_t k = 0;
        for (; k + 4 <= na; k += 4) {
            __m256d lanes[4];
            for (int m = 0; m < 4; m++)
                lanes[m] = _mm256_mul_pd(_mm256_loadu_pd(y + 8 * (k + m)), _mm256_loadu_pd(y + 8 * (k + m) + 4));
            _mm256_storeu_pd(out + k, run_products4(lanes[0], lanes[1], lanes[2], lanes[3]));
        }
        for (; k < na; k++) out[k] = run_product(y + 8 * k, 8);
        ln_array_avx2(out, out, na);
        for (k = 0; k + 4 <= nb; k += 4)
            _mm256_storeu_pd(prod + k, run_products4(run_lanes(y + G * k, G), run_lanes(y + G * (k + 1), G),
                                                     run_lanes(y + G * (k + 2), G), run_lanes(y + G * (k + 3), G)));
        for (; k < nb; k++) prod[k] = run_product(y + G * k, G);
        ln_array_avx2(prod, b->prefix + jb + 1, nb);
        e += len, ja += na, jb += nb;
    }
    return flags_done(bad, bits, varies, flags) && !(*flags & 3);
}

/* ------------------------------------------------------------------ AVX-512 grouped values (LEVEL_AVX512 and up)
 * The same values as groups_scalar, eight logs per register. Two exact rewrites: y' = fma(x, 2^-44, 1e-12 2^-44)
 * equals (x + 1e-12) 2^-44 (a power-of-two scaling commutes with rounding while nothing is subnormal, and
 * 1e-12 2^-44 is exact), and the flags come from integer reductions of the bits: x = g * g is +0 or positive
 * unless NaN, so as unsigned integers max(x) > FLT_MAX's bits exactly when some x is NaN or infinite, some x
 * differs from x0 exactly when min(x) or max(x) does (no NaN), and some g != 0 exactly when the OR of the g bits
 * has a bit other than the sign. */
#define T512P __attribute__((target("avx512f,avx512vl,avx512dq,avx2,fma")))

T512P static inline __m512d ln_positive8(__m512d x) {
    const __m512i bits = _mm512_add_epi64(_mm512_castpd_si512(x), _mm512_set1_epi64((int64_t)LN_SHIFT));
    const __m512i biased = _mm512_or_si512(_mm512_srli_epi64(bits, 52), _mm512_set1_epi64(0x4330000000000000LL));
    const __m512d e = _mm512_sub_pd(_mm512_castsi512_pd(biased), _mm512_set1_pd(4503599627371519.0));
    const __m512d m = _mm512_castsi512_pd(_mm512_add_epi64(
        _mm512_and_si512(bits, _mm512_set1_epi64(0x000fffffffffffffLL)), _mm512_set1_epi64((int64_t)LN_MID)));
    const __m512d one = _mm512_set1_pd(1.0);
    const __m512d s = _mm512_div_pd(_mm512_sub_pd(m, one), _mm512_add_pd(m, one)), z = _mm512_mul_pd(s, s);
    __m512d poly = _mm512_set1_pd(ATANH_SERIES[0]);
    for (int k = 1; k < 10; k++) poly = _mm512_fmadd_pd(poly, z, _mm512_set1_pd(ATANH_SERIES[k]));
    const __m512d s2 = _mm512_add_pd(s, s);
    const __m512d lnm = _mm512_fmadd_pd(_mm512_mul_pd(s2, z), poly, s2);
    return _mm512_fmadd_pd(e, _mm512_set1_pd(LN2_HI), _mm512_add_pd(lnm, _mm512_mul_pd(e, _mm512_set1_pd(LN2_LO))));
}

/* out[i] = ln(in[i]) for i < m (in place allowed), eight at a time, the last m % 8 by masked loads (the lanes past
 * m as 1) and stores. */
T512P static void ln_array_avx512(const double *in, double *out, int64_t m) {
    int64_t i = 0;
    for (; i + 8 <= m; i += 8) _mm512_storeu_pd(out + i, ln_positive8(_mm512_loadu_pd(in + i)));
    if (i < m) {
        const __mmask8 k = (__mmask8)((1u << (m - i)) - 1);
        _mm512_mask_storeu_pd(out + i, k, ln_positive8(_mm512_mask_loadu_pd(_mm512_set1_pd(1.0), k, in + i)));
    }
}

/* The flag reductions of 16 elements g (as integers) and their squares x. */
typedef struct {
    __m512i x_max, x_min, g_or;
} flags512;

T512P static inline __m512 square16(const float *g, flags512 *f) {
    const __m512 gi = _mm512_loadu_ps(g), x = _mm512_mul_ps(gi, gi);
    f->x_max = _mm512_max_epu32(f->x_max, _mm512_castps_si512(x));
    f->x_min = _mm512_min_epu32(f->x_min, _mm512_castps_si512(x));
    f->g_or = _mm512_or_si512(f->g_or, _mm512_castps_si512(gi));
    return x;
}

T512P static inline flags512 flags512_start(float x0) {
    uint32_t x0_bits;
    memcpy(&x0_bits, &x0, 4);
    flags512 f = {_mm512_setzero_si512(), _mm512_set1_epi32((int)x0_bits), _mm512_setzero_si512()};
    return f;
}

/* The flags of the reductions: 0 when some x is NaN or infinite (the values are unusable), else 1. */
T512P static int flags512_done(const flags512 *f, float x0, int *flags) {
    uint32_t x0_bits;
    memcpy(&x0_bits, &x0, 4);
    if (_mm512_reduce_max_epu32(f->x_max) > 0x7f7fffffu) return 0;
    if (_mm512_reduce_or_epi32(f->g_or) & 0x7fffffff) *flags |= 4;
    if (_mm512_reduce_max_epu32(f->x_max) != x0_bits || _mm512_reduce_min_epu32(f->x_min) != x0_bits) *flags |= 8;
    return 1;
}

T512P static inline __m512d scaled_y_pd(__m256 x) {
    return _mm512_fmadd_pd(_mm512_cvtps_pd(x), _mm512_set1_pd(0x1p-44), _mm512_set1_pd(1e-12 * 0x1p-44));
}

/* group8_avx2's values eight groups (64 elements) at a time: per 16 elements (groups A, B) one register of the
 * lanes y'_k y'_{k+4} (A's in lanes 0-3, B's in 4-7), then (a0 a1)(a2 a3) of eight groups by two levels of
 * in-lane pairs, one permutation back to the groups' order, and eight logs; the last (j1 - j0) % 8 groups in
 * scalar. Returns 0 (values unusable) when a value is not finite or squares to an overflow, else 1. */
T512P static int group8_avx512(const float *g, double *out, int64_t j0, int64_t j1, float x0, int *flags) {
    flags512 f = flags512_start(x0);
    /* floats 0-3 of A, 0-3 of B, then 4-7 of A, 4-7 of B */
    const __m512i halves = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
    const __m512i order = _mm512_setr_epi64(0, 2, 1, 3, 4, 6, 5, 7);
    int64_t j = j0;
    while (j + 8 <= j1) { /* batches of up to 64 groups: their products into out, then their logs in place */
      const int64_t batch_end = j + 64 <= j1 ? j + 64 : j + ((j1 - j) & ~(int64_t)7), start = j;
      for (; j < batch_end; j += 8) {
        __m512d a[4];
        for (int k = 0; k < 4; k++) {
            const __m512 x = _mm512_permutexvar_ps(halves, square16(g + 8 * j + 16 * k, &f));
            a[k] = _mm512_mul_pd(scaled_y_pd(_mm512_castps512_ps256(x)), scaled_y_pd(_mm512_extractf32x8_ps(x, 1)));
        }
        /* a[0] = (A0 A1 A2 A3 B0 B1 B2 B3), a[1] = (C.. D..): q0 = (A01 C01 A23 C23 B01 D01 B23 D23) */
        const __m512d q0 = _mm512_mul_pd(_mm512_unpacklo_pd(a[0], a[1]), _mm512_unpackhi_pd(a[0], a[1]));
        const __m512d q1 = _mm512_mul_pd(_mm512_unpacklo_pd(a[2], a[3]), _mm512_unpackhi_pd(a[2], a[3]));
        /* (A01 C01 B01 D01 E01 G01 F01 H01) times (A23 ...): the groups in the order A C B D E G F H */
        const __m512d p = _mm512_mul_pd(_mm512_shuffle_f64x2(q0, q1, 0x88), _mm512_shuffle_f64x2(q0, q1, 0xDD));
        _mm512_storeu_pd(out + j + 1, _mm512_permutexvar_pd(order, p));
      }
      ln_array_avx512(out + start + 1, out + start + 1, batch_end - start);
    }
    if (!flags512_done(&f, x0, flags)) return 0;
    groups8_scalar(g, out, j, j1, x0, flags);
    return !(*flags & 3);
}

/* y'[i] of the len elements at g into y (then 16 ones: the masked loads below may read past a piece), squared,
 * checked and scaled 16 at a time, the last len % 16 in scalar. */
T512P static void piece_y_avx512(const float *g, int64_t len, double *y, flags512 *f, float x0, int *flags) {
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
        const __m512 x = square16(g + i, f);
        _mm512_storeu_pd(y + i, scaled_y_pd(_mm512_castps512_ps256(x)));
        _mm512_storeu_pd(y + i + 8, scaled_y_pd(_mm512_extractf32x8_ps(x, 1)));
    }
    for (; i < len; i++) {
        const float gi = g[i], x = gi * gi;
        element_flags(gi, x, x0, flags);
        y[i] = scaled_y(x);
    }
    for (int64_t k = 0; k < 16; k++) y[len + k] = 1.0;
}

/* The products of count groups of G (2..PERIOD_RUN, one run each) of y into prod: run_product's lanes a_k by
 * masked loads (missing factors as 1), four groups at a time (run_products4), the last count % 4 in scalar. */
T512P static void products1_avx512(const double *y, int64_t G, int64_t count, double *prod) {
    const __mmask8 m0 = (__mmask8)(G >= 4 ? 0xF : (1 << G) - 1);
    const __mmask8 m1 = (__mmask8)(G >= 8 ? 0xF : G <= 4 ? 0 : (1 << (G - 4)) - 1);
    const __mmask8 m2 = (__mmask8)(G <= 8 ? 0 : (1 << (G - 8)) - 1);
    const __m256d one = _mm256_set1_pd(1.0);
    int64_t k = 0;
    for (; k + 4 <= count; k += 4) {
        __m256d lanes[4];
        for (int q = 0; q < 4; q++) {
            const double *r = y + (k + q) * G;
            __m256d v = _mm256_mask_loadu_pd(one, m0, r);
            if (m1) v = _mm256_mul_pd(v, _mm256_mask_loadu_pd(one, m1, r + 4));
            if (m2) v = _mm256_mul_pd(v, _mm256_mask_loadu_pd(one, m2, r + 8));
            lanes[q] = v;
        }
        _mm256_storeu_pd(prod + k, run_products4(lanes[0], lanes[1], lanes[2], lanes[3]));
    }
    for (; k < count; k++) prod[k] = run_product(y + k * G, G);
}

/* groups_scalar for one run per group (2 <= G <= PERIOD_RUN): pieces of whole groups (at most PERIOD_PIECE
 * elements) into y' (piece_y_avx512), their products (products1_avx512), their logs eight at a time. Returns 0
 * (values unusable) when a value is not finite or squares to an overflow, else 1. */
T512P static int groups1_avx512(const float *g, const period_class *c, int64_t j0, int64_t j1, float x0,
                                int *flags) {
    double y[PERIOD_PIECE + 16], prod[PERIOD_PIECE];
    const int64_t G = c->group, per_piece = PERIOD_PIECE / G;
    flags512 f = flags512_start(x0);
    for (int64_t j = j0; j < j1;) {
        const int64_t count = j1 - j < per_piece ? j1 - j : per_piece;
        piece_y_avx512(g + j * G, count * G, y, &f, x0, flags);
        products1_avx512(y, G, count, prod);
        ln_array_avx512(prod, c->prefix + j + 1, count);
        j += count;
    }
    return flags512_done(&f, x0, flags) && !(*flags & 3);
}

/* ------------------------------------------------------------------ prefix and scores, AVX2 */
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
        _mm256_storeu_pd(P + i + 1, _mm256_add_pd(carry, a));
        /* the next running value, carry + (d2 + d3) + (d0 + d1): out's last lane, without waiting for out */
        carry = _mm256_add_pd(carry, _mm256_permute4x64_pd(a, 0xFF));
    }
    double last[4];
    _mm256_storeu_pd(last, carry);
    *run = last[0];
    return i;
}

/* score_range for a stride of 1 (p = G): the lanes of 4 consecutive b in one register (the same lanes and order). */
__attribute__((target("avx2"))) static double score_range1_avx2(const double *P, int64_t B, int64_t v0, int64_t v1) {
    int64_t b = v0 < 1 ? 1 : v0, b1 = v1 < B ? v1 : B;
    if (b >= b1) return 0.0;
    const __m256d sign = _mm256_set1_pd(-0.0);
    __m256d acc = _mm256_setzero_pd();
    for (; b + 4 <= b1; b += 4) {
        const __m256d p0 = _mm256_loadu_pd(P + b - 1), p1 = _mm256_loadu_pd(P + b), p2 = _mm256_loadu_pd(P + b + 1);
        const __m256d d = _mm256_sub_pd(_mm256_sub_pd(p2, p1), _mm256_sub_pd(p1, p0)); /* D_b - D_{b-1} */
        acc = _mm256_add_pd(acc, _mm256_andnot_pd(sign, d));
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, acc);
    double total = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    for (; b < b1; b++) total += fabs((P[b + 1] - P[b]) - (P[b] - P[b - 1]));
    return total;
}
