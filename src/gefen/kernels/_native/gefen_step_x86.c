/*
 * The x86 vector passes of the step (AVX2 + FMA + F16C; AVX-512 F/BW/VL/DQ; AVX-512 VBMI), natively. Included by
 * gefen_kernels.c (one shared library, one translation unit) after its scalar passes and per-block driver types;
 * every function here gives the results of the scalar pass it replaces (see the rounding rules there).
 */
#if GEFEN_X86
/* CALL(gradient dtype, high) with both as compile-time constants (the pass-1 bodies' specialisations): CALL
 * returns. */
#define DISPATCH_GRAD_LERP(gdt, high, CALL)                                                                            \
    switch ((gdt) * 2 + (high)) {                                                                                      \
    case DT_F32 * 2: CALL(DT_F32, 0);                                                                                  \
    case DT_F32 * 2 + 1: CALL(DT_F32, 1);                                                                              \
    case DT_BF16 * 2: CALL(DT_BF16, 0);                                                                                \
    case DT_BF16 * 2 + 1: CALL(DT_BF16, 1);                                                                            \
    case DT_F16 * 2: CALL(DT_F16, 0);                                                                                  \
    default: CALL(DT_F16, 1);                                                                                          \
    }
/* ---------------- AVX2 + FMA + F16C: 8 lanes */
#define T2 __attribute__((target("avx2,fma,f16c")))
T2 static inline __m256 ld8(const void *p, int64_t i, int64_t dt) {
    if (dt == DT_F32) return _mm256_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (dt == DT_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}
T2 static inline void st8(void *p, int64_t i, int64_t dt, __m256 x) {
    if (dt == DT_F32) {
        _mm256_storeu_ps((float *)p + i, x);
        return;
    }
    __m128i h;
    if (dt == DT_BF16) {
        __m256i b = _mm256_castps_si256(x);
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb), 16);
        __m256 isnan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
        r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(isnan));
        h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    } else {
        h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), h);
}
/* cb[c[0..8)]: eight scalar loads put together (cheaper than vgatherdps on AMD Zen 2/3 and Intel alike). */
T2 static inline __m256 decode8(const float *cb, const uint8_t *c) {
    uint64_t w;
    memcpy(&w, c, 8);
    __m128 lo = _mm_setr_ps(cb[w & 255], cb[(w >> 8) & 255], cb[(w >> 16) & 255], cb[(w >> 24) & 255]);
    __m128 hi = _mm_setr_ps(cb[(w >> 32) & 255], cb[(w >> 40) & 255], cb[(w >> 48) & 255], cb[w >> 56]);
    return _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
}

/* Software prefetch distance of pass 1's streams (gradient, codes), in elements: Zen 1, 1 thread, 8M-element
 * factored weight from DRAM, pass 1 1.12-1.22 -> 0.88-0.92 ns/element (T0; pass 2's parameter stream gained
 * nothing). */
#define AVX2_PREFETCH 1024
/* Pass 1 of a block, 16 elements at a time (the two 8-lane halves are the sum's lanes 0-7 and 8-15, as in
 * every ISA); gdt, high and zero are compile-time constants at every call site (zero: see pass1_vbmi_body). */
T2 static INLINE float pass1_avx2_body(const gefen_step_args *a, int64_t base, int64_t P, float a_old, float *buf,
                                       float *sq, const int gdt, const int high, const int zero) {
    const __m256 vw = _mm256_set1_ps(high ? a->w - 1.0f : a->w), vold = _mm256_set1_ps(a_old);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const uint8_t *codes = a->codes + base;
    const float *cb = a->codebook;
    const char *grad = (const char *)a->grad + base * (gdt == DT_F32 ? 4 : 2);
    __m256 mx0 = _mm256_setzero_ps(), mx1 = _mm256_setzero_ps(), acc0 = _mm256_setzero_ps(), acc1 = acc0;
    const int64_t full = P - P % 16;
    for (int64_t j = 0; j < full; j += 16) {
        _mm_prefetch(grad + (j + AVX2_PREFETCH) * (gdt == DT_F32 ? 4 : 2), _MM_HINT_T0);
        if (!zero && (j & 63) == 0) _mm_prefetch((const char *)codes + j + AVX2_PREFETCH, _MM_HINT_T0);
        const __m256 g0 = ld8(grad, j, gdt), g1 = ld8(grad, j + 8, gdt);
        __m256 mo0 = _mm256_setzero_ps(), mo1 = mo0;
        if (!zero) {
            mo0 = _mm256_mul_ps(decode8(cb, codes + j), vold);
            mo1 = _mm256_mul_ps(decode8(cb, codes + j + 8), vold);
        }
        const __m256 m0 = _mm256_fmadd_ps(vw, _mm256_sub_ps(g0, mo0), high ? g0 : mo0);
        const __m256 m1 = _mm256_fmadd_ps(vw, _mm256_sub_ps(g1, mo1), high ? g1 : mo1);
        _mm256_storeu_ps(buf + j, m0);
        _mm256_storeu_ps(buf + j + 8, m1);
        mx0 = _mm256_max_ps(mx0, _mm256_and_ps(m0, absmask)); /* a NaN m is found below, not here */
        mx1 = _mm256_max_ps(mx1, _mm256_and_ps(m1, absmask));
        acc0 = _mm256_fmadd_ps(g0, g0, acc0);
        acc1 = _mm256_fmadd_ps(g1, g1, acc1);
    }
    /* A NaN m needs a non-finite g (then a lane of acc is NaN or inf) or a non-finite m_old = c * a_old: only then
     * are the m of this loop looked at again (as in pass1_vbmi_body). */
    const __m256 inf_or_nan = _mm256_or_ps(_mm256_cmp_ps(_mm256_sub_ps(acc0, acc0), _mm256_setzero_ps(), _CMP_NEQ_UQ),
                                           _mm256_cmp_ps(_mm256_sub_ps(acc1, acc1), _mm256_setzero_ps(), _CMP_NEQ_UQ));
    int has_nan = 0;
    if (full && !(fabsf(a_old) <= FLT_MAX && _mm256_movemask_ps(inf_or_nan) == 0))
        for (int64_t i = 0; i < full; i++) has_nan |= buf[i] != buf[i];
    float lanes[16], maxes[8], m_out = 0.0f;
    _mm256_storeu_ps(lanes, acc0);
    _mm256_storeu_ps(lanes + 8, acc1);
    _mm256_storeu_ps(maxes, _mm256_max_ps(mx0, mx1));
    for (int k = 0; k < 8; k++)
        if (maxes[k] > m_out) m_out = maxes[k];
    float total = sum16(lanes);
    pass1_tail(a, base, full, P, a_old, buf, &total, &m_out, &has_nan);
    *sq = total;
    return has_nan ? NAN : m_out;
}
T2 static float pass1_avx2(const gefen_step_args *a, int64_t base, int64_t P, float a_old, float *buf, float *sq) {
    const int high = a->lerp_high != 0, zero = a_old == 0.0f;
#define P1(gdt, hi)                                                                                                    \
    return zero ? pass1_avx2_body(a, base, P, a_old, buf, sq, gdt, hi, 1)                                              \
                : pass1_avx2_body(a, base, P, a_old, buf, sq, gdt, hi, 0)
    DISPATCH_GRAD_LERP(a->grad_dtype, high, P1);
#undef P1
}

T2 static inline __m256i nearest8(const gefen_step_args *a, __m256 u) {
    __m256 t = _mm256_mul_ps(_mm256_add_ps(u, _mm256_set1_ps(1.0f)), _mm256_set1_ps(2048.0f));
    __m256i b = _mm256_cvttps_epi32(t); /* NaN / overflow -> INT_MIN -> clamped to 0 */
    b = _mm256_min_epi32(_mm256_max_epi32(b, _mm256_setzero_si256()), _mm256_set1_epi32(4095));
    __m256i idx = _mm256_i32gather_epi32(a->lut, b, 4);
    for (int64_t s = 0; s < a->steps; s++) {
        __m256 th = _mm256_i32gather_ps(a->thresholds, idx, 4);
        idx = _mm256_sub_epi32(idx, _mm256_castps_si256(_mm256_cmp_ps(th, u, _CMP_LT_OQ)));
    }
    return idx;
}

T2 static void pass2_avx2(const gefen_step_args *a, int64_t base, int64_t j0, int64_t j1, const float *buf,
                          float denom, float amag, float s, const float *col_root, float row_root, int64_t c0) {
    const __m256 vden = _mm256_set1_ps(denom), vmag = _mm256_set1_ps(amag), vs = _mm256_set1_ps(s);
    const __m256 vrow = _mm256_set1_ps(row_root), veps = _mm256_set1_ps(a->eps);
    const __m256 vdecay = _mm256_set1_ps(a->decay), vstep = _mm256_set1_ps(a->step);
    int64_t j = j0;
    for (; j + 8 <= j1; j += 8) {
        __m256 u = _mm256_div_ps(_mm256_loadu_ps(buf + j), vden);
        __m256i idx = nearest8(a, u);
        __m256i packed = _mm256_packus_epi32(idx, idx); /* 16-bit, lanes 0-3 | 8-11 */
        packed = _mm256_permute4x64_epi64(packed, 0x08);
        __m128i bytes = _mm_packus_epi16(_mm256_castsi256_si128(packed), _mm256_castsi256_si128(packed));
        _mm_storel_epi64((__m128i *)(a->codes + base + j), bytes);
        __m256 m_hat = _mm256_mul_ps(_mm256_i32gather_ps(a->codebook, idx, 4), vmag);
        if (a->kind == KIND_MOMENTUM) {
            _mm256_storeu_ps(a->out + base + j, m_hat);
            continue;
        }
        __m256 d;
        if (a->kind == KIND_FACTORED) {
            __m256 den = _mm256_add_ps(_mm256_mul_ps(vrow, _mm256_loadu_ps(col_root + c0 + (j - j0))), veps);
            d = _mm256_div_ps(m_hat, den);
        } else {
            d = _mm256_mul_ps(m_hat, vs);
        }
        __m256 p = _mm256_mul_ps(ld8(a->param, base + j, a->param_dtype), vdecay);
        st8(a->param, base + j, a->param_dtype, _mm256_fmadd_ps(d, vstep, p));
    }
    pass2_scalar(a, base, j, j1, buf, denom, amag, s, col_root, row_root, c0 + (j - j0));
}

/* u = m / den by Markstein's correction of m * (1/den) (den in [2^-64, 2^64]: the correctly rounded quotient). */
T2 static inline __m256 quotient8(__m256 m, __m256 den, __m256 inv, int exact) {
    if (!exact) return _mm256_div_ps(m, den);
    __m256 q = _mm256_mul_ps(m, inv);
    return _mm256_fmadd_ps(_mm256_fnmadd_ps(q, den, m), inv, q);
}

/* The entries of 8 buckets given as byte offsets o[0..8) (16 * bucket), transposed: threshold, lower and upper code
 * values, and k (int32 bits) of elements 0..7 in order. */
T2 static inline __attribute__((always_inline)) void entries8(const float *entry, const uint32_t *o, __m256 *th,
                                                              __m256 *lo, __m256 *hi, __m256 *k0) {
    const char *e = (const char *)entry;
#define ENTRY(x) _mm_load_ps((const float *)(e + (x)))
#define ENTRY_PAIR(x, y) _mm256_insertf128_ps(_mm256_castps128_ps256(ENTRY(x)), ENTRY(y), 1)
    const __m256 r0 = ENTRY_PAIR(o[0], o[4]), r1 = ENTRY_PAIR(o[1], o[5]);
    const __m256 r2 = ENTRY_PAIR(o[2], o[6]), r3 = ENTRY_PAIR(o[3], o[7]);
#undef ENTRY_PAIR
#undef ENTRY
    const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    *th = _mm256_shuffle_ps(t0, t2, 0x44);
    *lo = _mm256_shuffle_ps(t0, t2, 0xEE);
    *hi = _mm256_shuffle_ps(t1, t3, 0x44);
    *k0 = _mm256_shuffle_ps(t1, t3, 0xEE);
}

/* Pass 2 with the entry table, in pieces of PASS2E_PIECE elements, each in two loops: first every u and its bucket's
 * byte offset into buffers on the stack, then the entry loads, the compare, the codes and the parameter update.
 * One loop doing both was latency-bound (the chain division -> bucket -> offset -> entry load -> transpose ->
 * compare -> update of one iteration was about as long as the iteration, and two iterations do not fit in Zen 1's
 * reorder window): split, each loop's iterations are independent and overlap (Zen 1, cache-resident: 2.10 -> 1.65
 * ns/element factored, 1.97 -> 1.50 block). One 16-byte load per element and a 4x4 transpose instead of 3
 * gathers; buckets as bucket_of (no clamp needed for |u| <= 1). */
#define PASS2E_PIECE 256
T2 static INLINE void pass2_avx2e_body(const gefen_step_args *a, const entry_table *et, int64_t base, int64_t j0,
                                       int64_t j1, const float *buf, float denom, float amag, float s,
                                       const float *col_root, float row_root, int64_t c0, const int kind,
                                       const int pdt, const int markstein, const int clamp) {
    const __m256 vden = _mm256_set1_ps(denom), vmag = _mm256_set1_ps(amag), vs = _mm256_set1_ps(s);
    const __m256 vinv = _mm256_set1_ps(1.0f / denom), half = _mm256_set1_ps(bucket_half(et->buckets));
    const __m256 vrow = _mm256_set1_ps(row_root), veps = _mm256_set1_ps(a->eps);
    const __m256 vdecay = _mm256_set1_ps(a->decay), vstep = _mm256_set1_ps(a->step);
    const __m256i last = _mm256_set1_epi32((int)et->buckets - 1), zero = _mm256_setzero_si256();
    uint32_t offs[PASS2E_PIECE] __attribute__((aligned(32)));
    float us[PASS2E_PIECE] __attribute__((aligned(32)));
    int64_t j = j0;
    while (j + 8 <= j1) {
        const int64_t left = (j1 - j) & ~(int64_t)7, n = left < PASS2E_PIECE ? left : PASS2E_PIECE;
        for (int64_t i = 0; i < n; i += 8) {
            const __m256 u = quotient8(_mm256_loadu_ps(buf + j + i), vden, vinv, markstein);
            __m256i b = _mm256_cvttps_epi32(_mm256_fmadd_ps(u, half, half)); /* |u| <= 1: [0, buckets) */
            if (clamp) b = _mm256_min_epi32(_mm256_max_epi32(b, zero), last); /* NaN (INT_MIN) or |u| > 1 */
            _mm256_store_si256((__m256i *)(offs + i), _mm256_slli_epi32(b, 4));
            _mm256_store_ps(us + i, u);
        }
        /* two turns per iteration: Zen 1, the whole step 0.96-0.99 of the time in five A/B runs (1 and 2 threads) */
        UNROLL2
        for (int64_t i = 0; i < n; i += 8) {
            __m256 th, lo, hi, k0;
            entries8(et->entry, offs + i, &th, &lo, &hi, &k0);
            const __m256 pass = _mm256_cmp_ps(th, _mm256_load_ps(us + i), _CMP_LT_OQ);
            const __m256i idx = _mm256_sub_epi32(_mm256_castps_si256(k0), _mm256_castps_si256(pass));
            const __m256 m_hat = _mm256_mul_ps(_mm256_blendv_ps(lo, hi, pass), vmag);
            const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(idx), _mm256_extracti128_si256(idx, 1));
            _mm_storel_epi64((__m128i *)(a->codes + base + j + i), _mm_packus_epi16(w, w));
            const int64_t e = base + j + i;
            if (kind == KIND_MOMENTUM) {
                _mm256_storeu_ps(a->out + e, m_hat);
                continue;
            }
            __m256 d;
            if (kind == KIND_FACTORED) {
                __m256 den = _mm256_add_ps(_mm256_mul_ps(vrow, _mm256_loadu_ps(col_root + c0 + (j + i - j0))), veps);
                d = _mm256_div_ps(m_hat, den);
            } else {
                d = _mm256_mul_ps(m_hat, vs);
            }
            __m256 p = _mm256_mul_ps(ld8(a->param, e, pdt), vdecay);
            st8(a->param, e, pdt, _mm256_fmadd_ps(d, vstep, p));
        }
        j += n;
    }
    pass2_scalar(a, base, j, j1, buf, denom, amag, s, col_root, row_root, c0 + (j - j0));
}
T2 static void pass2_avx2e(const gefen_step_args *a, const entry_table *et, int64_t base, int64_t j0, int64_t j1,
                           const float *buf, float denom, float amag, float s, const float *col_root, float row_root,
                           int64_t c0) {
    /* As pass2_vbmi: Markstein's quotient where denom allows it; buckets clamped only when max |m| is not finite
     * (NaN, or inf: then u = m / inf may be NaN). */
    const int markstein = denom >= 0x1p-64f && denom <= 0x1p64f, clamp = !(amag >= 0.0f && amag <= FLT_MAX);
#define P2E(kind, pdt)                                                                                                 \
    do {                                                                                                               \
        if (clamp) pass2_avx2e_body(a, et, base, j0, j1, buf, denom, amag, s, col_root, row_root, c0, kind, pdt, 0, 1); \
        else if (markstein)                                                                                            \
            pass2_avx2e_body(a, et, base, j0, j1, buf, denom, amag, s, col_root, row_root, c0, kind, pdt, 1, 0);       \
        else pass2_avx2e_body(a, et, base, j0, j1, buf, denom, amag, s, col_root, row_root, c0, kind, pdt, 0, 0);      \
    } while (0)
    DISPATCH_KIND_DTYPE(a, P2E);
#undef P2E
}

/* ---------------- AVX-512 (F, BW, VL): 16 lanes */
#define T5 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
T5 static inline __attribute__((always_inline)) __m512 ld16(const void *p, int64_t i, int64_t dt) {
    if (dt == DT_F32) return _mm512_loadu_ps((const float *)p + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    if (dt == DT_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}
T5 static inline __attribute__((always_inline)) void st16(void *p, int64_t i, int64_t dt, __m512 x) {
    if (dt == DT_F32) {
        _mm512_storeu_ps((float *)p + i, x);
        return;
    }
    __m256i h;
    if (dt == DT_BF16) {
        __m512i b = _mm512_castps_si512(x);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb), 16);
        __mmask16 isnan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        r = _mm512_mask_mov_epi32(r, isnan, _mm512_set1_epi32(0x7fc0));
        h = _mm512_cvtepi32_epi16(r);
    } else {
        h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), h);
}

/* The 16-lane part of pass 1 over [j0, full) with gathers, continuing the accumulators of a caller. */
T5 static inline __attribute__((always_inline)) void pass1_lanes16(const gefen_step_args *a, int64_t base, int64_t j0,
                                                                  int64_t full, float a_old, float *buf, __m512 *mx,
                                                                  __m512 *acc, __mmask16 *nan) {
    const __m512 vw = _mm512_set1_ps(a->lerp_high ? a->w - 1.0f : a->w), vold = _mm512_set1_ps(a_old);
    for (int64_t j = j0; j < full; j += 16) {
        __m512 g = ld16(a->grad, base + j, a->grad_dtype);
        __m512i ci = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(a->codes + base + j)));
        __m512 mo = _mm512_mul_ps(_mm512_i32gather_ps(ci, a->codebook, 4), vold);
        __m512 d = _mm512_sub_ps(g, mo);
        __m512 m = _mm512_fmadd_ps(vw, d, a->lerp_high ? g : mo);
        _mm512_storeu_ps(buf + j, m);
        *nan |= _mm512_cmp_ps_mask(m, m, _CMP_UNORD_Q);
        *mx = _mm512_max_ps(*mx, _mm512_abs_ps(m));
        *acc = _mm512_fmadd_ps(g, g, *acc);
    }
}

/* Lane reduction and the scalar tail shared by the AVX-512 passes. */
T5 static inline float pass1_finish512(const gefen_step_args *a, int64_t base, int64_t full, int64_t P, float a_old,
                                       float *buf, __m512 mx, __m512 acc, __mmask16 nan, float *sq) {
    float lanes[16];
    _mm512_storeu_ps(lanes, acc);
    float total = sum16(lanes), m_out = _mm512_reduce_max_ps(mx);
    int has_nan = nan != 0;
    pass1_tail(a, base, full, P, a_old, buf, &total, &m_out, &has_nan);
    *sq = total;
    return has_nan ? NAN : m_out;
}

T5 static float pass1_avx512(const gefen_step_args *a, int64_t base, int64_t P, float a_old, float *buf, float *sq) {
    __m512 mx = _mm512_setzero_ps(), acc = _mm512_setzero_ps();
    __mmask16 nan = 0;
    const int64_t full = P - P % 16;
    pass1_lanes16(a, base, 0, full, a_old, buf, &mx, &acc, &nan);
    return pass1_finish512(a, base, full, P, a_old, buf, mx, acc, nan, sq);
}

T5 static inline __m512i nearest16(const gefen_step_args *a, __m512 u) {
    __m512 t = _mm512_mul_ps(_mm512_add_ps(u, _mm512_set1_ps(1.0f)), _mm512_set1_ps(2048.0f));
    __m512i b = _mm512_cvttps_epi32(t);
    b = _mm512_min_epi32(_mm512_max_epi32(b, _mm512_setzero_si512()), _mm512_set1_epi32(4095));
    __m512i idx = _mm512_i32gather_epi32(b, a->lut, 4);
    const __m512i one = _mm512_set1_epi32(1);
    for (int64_t s = 0; s < a->steps; s++) {
        __m512 th = _mm512_i32gather_ps(idx, a->thresholds, 4);
        idx = _mm512_mask_add_epi32(idx, _mm512_cmp_ps_mask(th, u, _CMP_LT_OQ), idx, one);
    }
    return idx;
}

T5 static void pass2_avx512(const gefen_step_args *a, int64_t base, int64_t j0, int64_t j1, const float *buf,
                            float denom, float amag, float s, const float *col_root, float row_root, int64_t c0) {
    const __m512 vden = _mm512_set1_ps(denom), vmag = _mm512_set1_ps(amag), vs = _mm512_set1_ps(s);
    const __m512 vrow = _mm512_set1_ps(row_root), veps = _mm512_set1_ps(a->eps);
    const __m512 vdecay = _mm512_set1_ps(a->decay), vstep = _mm512_set1_ps(a->step);
    int64_t j = j0;
    for (; j + 16 <= j1; j += 16) {
        __m512 u = _mm512_div_ps(_mm512_loadu_ps(buf + j), vden);
        __m512i idx = nearest16(a, u);
        _mm_storeu_si128((__m128i *)(a->codes + base + j), _mm512_cvtepi32_epi8(idx));
        __m512 m_hat = _mm512_mul_ps(_mm512_i32gather_ps(idx, a->codebook, 4), vmag);
        if (a->kind == KIND_MOMENTUM) {
            _mm512_storeu_ps(a->out + base + j, m_hat);
            continue;
        }
        __m512 d;
        if (a->kind == KIND_FACTORED) {
            __m512 den = _mm512_add_ps(_mm512_mul_ps(vrow, _mm512_loadu_ps(col_root + c0 + (j - j0))), veps);
            d = _mm512_div_ps(m_hat, den);
        } else {
            d = _mm512_mul_ps(m_hat, vs);
        }
        __m512 p = _mm512_mul_ps(ld16(a->param, base + j, a->param_dtype), vdecay);
        st16(a->param, base + j, a->param_dtype, _mm512_fmadd_ps(d, vstep, p));
    }
    pass2_scalar(a, base, j, j1, buf, denom, amag, s, col_root, row_root, c0 + (j - j0));
}

/* ---------------- AVX-512 VBMI: 64 elements at a time, table look-ups by byte shuffles instead of gathers.
 * A 256-entry fp32 table is held as 4 byte planes (plane k = byte k of every entry), 4 x 64 bytes each; one plane
 * is looked up for 64 uint8 indices by two vpermt2b (entries 0-127 and 128-255) and a blend on bit 7. The 4 planes
 * are re-assembled into floats by byte/word unpacks, which work inside 128-bit lanes; the indices are permuted
 * first (PERM64) so that the floats come out in element order. */
#define TV __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx2,fma,f16c")))

typedef struct {
    __m512i p[4][4]; /* plane k, 64-byte part q (entries 64q .. 64q+63) */
} planes256;

TV static void make_planes(planes256 *t, const float *table) {
    uint8_t bytes[4][256];
    for (int i = 0; i < 256; i++) {
        uint32_t b = f_bits(table[i]);
        for (int k = 0; k < 4; k++) bytes[k][i] = (uint8_t)(b >> (8 * k));
    }
    for (int k = 0; k < 4; k++)
        for (int q = 0; q < 4; q++) t->p[k][q] = _mm512_loadu_si512((const void *)(bytes[k] + 64 * q));
}

/* permuted[16j + 4k + q] = element[16k + 4j + q] (a 4x4 transpose of groups of 4; its own inverse) */
TV static inline __attribute__((always_inline)) __m512i perm64(__m512i x) {
    static const uint8_t order[64] = {0,  1,  2,  3,  16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51,
                                      4,  5,  6,  7,  20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,
                                      8,  9,  10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59,
                                      12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};
    return _mm512_permutexvar_epi8(_mm512_loadu_si512((const void *)order), x);
}

/* The 64-bit mask of four 16-lane masks (m[k] -> bits 16k .. 16k + 15), in mask registers. */
TV static inline __attribute__((always_inline)) __mmask64 join4(const __mmask16 m[4]) {
    return _mm512_kunpackd((__mmask64)_mm512_kunpackw(m[3], m[2]), (__mmask64)_mm512_kunpackw(m[1], m[0]));
}

/* table[idx] for 64 uint8 indices given in perm64 order; out[k] = elements 16k .. 16k+15 as fp32 */
TV static inline __attribute__((always_inline)) __m512i plane(const planes256 *t, int k, __m512i pidx,
                                                              __mmask64 high) {
    __m512i lo = _mm512_permutex2var_epi8(t->p[k][0], pidx, t->p[k][1]);
    __m512i hi = _mm512_permutex2var_epi8(t->p[k][2], pidx, t->p[k][3]);
    return _mm512_mask_blend_epi8(high, lo, hi);
}
TV static inline __attribute__((always_inline)) void lookup64(const planes256 *t, __m512i pidx, __m512 *o0,
                                                             __m512 *o1, __m512 *o2, __m512 *o3) {
    const __mmask64 high = _mm512_movepi8_mask(pidx);
    const __m512i b0 = plane(t, 0, pidx, high), b1 = plane(t, 1, pidx, high);
    const __m512i b2 = plane(t, 2, pidx, high), b3 = plane(t, 3, pidx, high);
    const __m512i w01l = _mm512_unpacklo_epi8(b0, b1), w01h = _mm512_unpackhi_epi8(b0, b1);
    const __m512i w23l = _mm512_unpacklo_epi8(b2, b3), w23h = _mm512_unpackhi_epi8(b2, b3);
    *o0 = _mm512_castsi512_ps(_mm512_unpacklo_epi16(w01l, w23l));
    *o1 = _mm512_castsi512_ps(_mm512_unpackhi_epi16(w01l, w23l));
    *o2 = _mm512_castsi512_ps(_mm512_unpacklo_epi16(w01h, w23h));
    *o3 = _mm512_castsi512_ps(_mm512_unpackhi_epi16(w01h, w23h));
}

struct vbmi_tables {
    planes256 codebook, thresholds;
    __m512i base[4][4]; /* base[q]: first code index of buckets 256q .. 256q+255, as bytes */
    int64_t buckets;    /* 256, 512 or 1024 uniform buckets over [-1, 1] */
    int64_t steps;      /* compares after the bucket look-up (thresholds below 1 in one bucket, at most) */
};

/* A bucket table of its own for the byte-shuffle search: `buckets` uniform buckets (chosen per codebook for the
 * fewest shuffles: a larger table costs 4 more per 256 entries, each compare step about 22), base[b] = number of
 * thresholds whose bucket (bucket_of) is below b. Any monotone bucket function gives the exact rule (see
 * gefen.math.lookup). */
TV static vbmi_tables *make_vbmi_tables(const gefen_step_args *a) {
    vbmi_tables *vt = (vbmi_tables *)aligned_alloc(64, sizeof(vbmi_tables));
    if (!vt) return 0;
    float thr[256];
    for (int i = 0; i < 256; i++) thr[i] = (i < 255 + a->steps) ? a->thresholds[i] : INFINITY;
    make_planes(&vt->codebook, a->codebook);
    make_planes(&vt->thresholds, thr);
    int64_t best_cost = -1;
    for (int64_t nb = 256; nb <= 1024; nb *= 2) {
        int32_t count[1024] = {0};
        int64_t steps = 0;
        for (int i = 0; i < 255; i++) {
            if (!(thr[i] < 1.0f)) continue;
            int64_t b = bucket_of(thr[i], nb);
            if (++count[b] > steps) steps = count[b];
        }
        int64_t cost = (nb / 256) * 4 + 22 * steps;
        if (best_cost >= 0 && cost >= best_cost) continue;
        best_cost = cost;
        vt->buckets = nb;
        vt->steps = steps;
        uint8_t base[1024];
        int i = 0;
        for (int64_t b = 0; b < nb; b++) { /* thresholds (all 255, +1 copies too) whose bucket is below b */
            while (i < 255 && bucket_of(thr[i], nb) < b) i++;
            base[b] = (uint8_t)i;
        }
        for (int64_t q = 0; q < nb / 256; q++)
            for (int r = 0; r < 4; r++) vt->base[q][r] = _mm512_loadu_si512((const void *)(base + 256 * q + 64 * r));
    }
    return vt;
}

/* table[idx] for 64 byte indices in element order -> 64 bytes in element order */
TV static inline __m512i bytes256(const __m512i t[4], __m512i idx) {
    __m512i lo = _mm512_permutex2var_epi8(t[0], idx, t[1]);
    __m512i hi = _mm512_permutex2var_epi8(t[2], idx, t[3]);
    return _mm512_mask_blend_epi8(_mm512_movepi8_mask(idx), lo, hi);
}

/* Software prefetch of the streams (gradient, codes, parameter): distance in elements ahead, and the level. Into
 * L2 (T1), not L1 (T0): the L2 keeps more misses in flight than the L1's fill buffers, which the four streams of a
 * step exhaust (Zen 4, 2 threads, the benchmark's 23.5M parameters from DRAM: native step 14.5-15.2 ms with T0,
 * 13.5-14.0 ms with T1; 1 thread 27-28 -> 24-26 ms; a distance of 2048 or 512 gains nothing). */
#ifndef PREFETCH_ELEMENTS
#define PREFETCH_ELEMENTS 1024
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_T1
#endif
/* Pass 1 of a block, 64 elements at a time; gdt and high are compile-time constants at every call site below. */
/* zero: a_old == 0 (a new parameter's first step, or an all-zero first moment): m_old = code * 0 is +-0 for every
 * code, so the codes are not read and m_old = +0 is used. m then differs at most in the sign of a zero, which
 * neither max |m| nor the nearest code (u = +-0 compare alike) can see. */
TV static INLINE float pass1_vbmi_body(const gefen_step_args *a, const vbmi_tables *vt, int64_t base, int64_t P,
                                       float a_old, float *buf, float *sq, const int gdt, const int high,
                                       const int zero) {
    const float wv = a->w;
    const __m512 vw = _mm512_set1_ps(high ? wv - 1.0f : wv), vold = _mm512_set1_ps(a_old);
    const uint8_t *codes = a->codes + base;
    const char *grad = (const char *)a->grad + base * (gdt == DT_F32 ? 4 : 2);
    __m512 mx = _mm512_setzero_ps(), acc = _mm512_setzero_ps();
    __mmask16 nan = 0;
    int64_t j = 0;
    for (; j + 64 <= P; j += 64) {
        __m512 c[4] = {vold, vold, vold, vold};
        if (!zero) {
            _mm_prefetch((const char *)(codes + j + PREFETCH_ELEMENTS), PREFETCH_HINT);
            lookup64(&vt->codebook, perm64(_mm512_loadu_si512((const void *)(codes + j))), &c[0], &c[1], &c[2],
                     &c[3]);
        }
        UNROLL4
        for (int k = 0; k < 4; k++) {
            _mm_prefetch(grad + (j + 16 * k + PREFETCH_ELEMENTS) * (gdt == DT_F32 ? 4 : 2), PREFETCH_HINT);
            __m512 g = ld16(grad, j + 16 * k, gdt);
            __m512 mo = zero ? _mm512_setzero_ps() : _mm512_mul_ps(c[k], vold);
            __m512 d = _mm512_sub_ps(g, mo);
            __m512 m = _mm512_fmadd_ps(vw, d, high ? g : mo);
            _mm512_storeu_ps(buf + j + 16 * k, m);
            mx = _mm512_range_ps(mx, m, 0x0B); /* max(mx, |m|): the larger magnitude, sign cleared; skips NaN */
            acc = _mm512_fmadd_ps(g, g, acc);
        }
    }
    /* A NaN m needs a non-finite g (then a lane of acc is NaN or inf) or a non-finite m_old = c * a_old: only then
     * are the m of this loop looked at again. */
    const __mmask16 finite_acc = _mm512_cmp_ps_mask(_mm512_sub_ps(acc, acc), _mm512_setzero_ps(), _CMP_EQ_OQ);
    if (j && !(fabsf(a_old) <= FLT_MAX && finite_acc == 0xFFFF))
        for (int64_t i = 0; i < j; i += 16) {
            const __m512 m = _mm512_loadu_ps(buf + i);
            nan |= _mm512_cmp_ps_mask(m, m, _CMP_UNORD_Q);
        }
    const int64_t full = P - P % 16;
    pass1_lanes16(a, base, j, full, a_old, buf, &mx, &acc, &nan);
    return pass1_finish512(a, base, full, P, a_old, buf, mx, acc, nan, sq);
}

TV static float pass1_vbmi(const gefen_step_args *a, const vbmi_tables *vt, int64_t base, int64_t P, float a_old,
                           float *buf, float *sq) {
    const int high = a->lerp_high != 0, zero = a_old == 0.0f;
#define P1(gdt, hi)                                                                                                    \
    return zero ? pass1_vbmi_body(a, vt, base, P, a_old, buf, sq, gdt, hi, 1)                                          \
                : pass1_vbmi_body(a, vt, base, P, a_old, buf, sq, gdt, hi, 0)
    DISPATCH_GRAD_LERP(a->grad_dtype, high, P1);
#undef P1
}

/* u = m / a for a whole block: Markstein's correction of m * (1/a) gives the correctly rounded quotient (checked
 * against true division); outside [2^-64, 2^64] (or for a = 0, NaN, inf) true division is used. */
TV static inline __attribute__((always_inline)) __m512 quotient16(__m512 m, __m512 den, __m512 inv, int exact) {
    if (!exact) return _mm512_div_ps(m, den);
    __m512 q = _mm512_mul_ps(m, inv);
    __m512 r = _mm512_fnmadd_ps(q, den, m);
    return _mm512_fmadd_ps(r, inv, q);
}

/* Groups of 64 elements interleaved per loop iteration in pass 2: each stage (quotient and bucket, bucket
 * bytes, base look-up, threshold compares, code look-up, update) runs over the groups in turn, so that their
 * dependency chains overlap (measured on Zen 4, 1 thread: 1 group 0.85 ns/element, 2 groups 0.78, 4 groups 0.70;
 * the same operations on every element, so the same results). */
#define PASS2_GROUPS 4
/* `groups` (1 or PASS2_GROUPS, a compile-time constant) groups of 64 elements of pass 2 from element j. */
TV static INLINE void pass2_vbmi_groups(const gefen_step_args *a, const vbmi_tables *vt, int64_t base, int64_t j,
                                        int64_t j0, const float *buf, float denom, float amag, float s,
                                        const float *col_root, float row_root, int64_t c0, const int kind,
                                        const int pdt, const int buckets, const int markstein, const int clamp,
                                        const int groups) {
    uint8_t *const codes = a->codes;
    float *const out = a->out;
    void *const param = a->param;
    const __m512 vden = _mm512_set1_ps(denom), vmag = _mm512_set1_ps(amag), vs = _mm512_set1_ps(s);
    const __m512 vinv = _mm512_set1_ps(1.0f / denom);
    const __m512 vrow = _mm512_set1_ps(row_root), veps = _mm512_set1_ps(a->eps);
    const __m512 vdecay = _mm512_set1_ps(a->decay), vstep = _mm512_set1_ps(a->step);
    const __m512i zero = _mm512_setzero_si512(), ones8 = _mm512_set1_epi8(1), twos8 = _mm512_set1_epi8(2);
    const __m512 half = _mm512_set1_ps(bucket_half(buckets));
    const __m512i last = _mm512_set1_epi32(buckets - 1), byte = _mm512_set1_epi16(255);
    __m512 u[PASS2_GROUPS][4];
    __m512i idx[PASS2_GROUPS];
    UNROLL4
    for (int g = 0; g < groups; g++) {
        __m512i b[4];
        UNROLL4
        for (int k = 0; k < 4; k++) {
            u[g][k] = quotient16(_mm512_loadu_ps(buf + j + 64 * g + 16 * k), vden, vinv, markstein);
            b[k] = _mm512_cvttps_epi32(_mm512_fmadd_ps(u[g][k], half, half)); /* |u| <= 1: [0, buckets); NaN: INT_MIN */
            if (clamp) b[k] = _mm512_min_epi32(_mm512_max_epi32(b[k], zero), last); /* u beyond [-1, 1] */
        }
        /* 16-bit buckets by unsigned saturation (INT_MIN -> 0), then their low bytes and (512 or 1024 buckets)
         * their high bits as bytes: the in-lane packs leave them in perm64 order, which perm64 undoes */
        const __m512i w01 = _mm512_packus_epi32(b[0], b[1]), w23 = _mm512_packus_epi32(b[2], b[3]);
        __m512i key, hi = zero;
        if (buckets > 256) {
            key = perm64(_mm512_packus_epi16(_mm512_and_si512(w01, byte), _mm512_and_si512(w23, byte)));
            hi = perm64(_mm512_packus_epi16(_mm512_srli_epi16(w01, 8), _mm512_srli_epi16(w23, 8)));
        } else {
            key = perm64(_mm512_packus_epi16(w01, w23));
        }
        const __mmask64 hi8 = _mm512_test_epi8_mask(hi, ones8), hi9 = _mm512_test_epi8_mask(hi, twos8);
        idx[g] = bytes256(vt->base[0], key);
        if (buckets >= 512) idx[g] = _mm512_mask_blend_epi8(hi8, idx[g], bytes256(vt->base[1], key));
        if (buckets >= 1024) {
            __m512i upper = _mm512_mask_blend_epi8(hi8, bytes256(vt->base[2], key), bytes256(vt->base[3], key));
            idx[g] = _mm512_mask_blend_epi8(hi9, idx[g], upper);
        }
    }
    for (int64_t st = 0; st < vt->steps; st++) {
        UNROLL4
        for (int g = 0; g < groups; g++) {
            __m512 t[4];
            lookup64(&vt->thresholds, perm64(idx[g]), &t[0], &t[1], &t[2], &t[3]);
            __mmask16 pass[4];
            UNROLL4
            for (int k = 0; k < 4; k++) pass[k] = _mm512_cmp_ps_mask(t[k], u[g][k], _CMP_LT_OQ);
            idx[g] = _mm512_mask_add_epi8(idx[g], join4(pass), idx[g], ones8);
        }
    }
    UNROLL4
    for (int g = 0; g < groups; g++) {
        const int64_t jg = j + 64 * g;
        _mm512_storeu_si512((void *)(codes + base + jg), idx[g]);
        __m512 c[4];
        lookup64(&vt->codebook, perm64(idx[g]), &c[0], &c[1], &c[2], &c[3]);
        UNROLL4
        for (int k = 0; k < 4; k++) {
            const int64_t e = base + jg + 16 * k;
            __m512 m_hat = _mm512_mul_ps(c[k], vmag);
            if (kind == KIND_MOMENTUM) {
                _mm512_storeu_ps(out + e, m_hat);
                continue;
            }
            __m512 d;
            if (kind == KIND_FACTORED) {
                __m512 den =
                    _mm512_add_ps(_mm512_mul_ps(vrow, _mm512_loadu_ps(col_root + c0 + (jg - j0) + 16 * k)), veps);
                d = _mm512_div_ps(m_hat, den); /* the divider runs beside the shuffle and FMA pipes */
            } else {
                d = _mm512_mul_ps(m_hat, vs);
            }
            _mm_prefetch((const char *)param + (e + PREFETCH_ELEMENTS) * (pdt == DT_F32 ? 4 : 2), PREFETCH_HINT);
            __m512 p = _mm512_mul_ps(ld16(param, e, pdt), vdecay);
            st16(param, e, pdt, _mm512_fmadd_ps(d, vstep, p));
        }
    }
}
TV static INLINE void pass2_vbmi_body(const gefen_step_args *a, const vbmi_tables *vt, int64_t base, int64_t j0,
                                      int64_t j1, const float *buf, float denom, float amag, float s,
                                      const float *col_root, float row_root, int64_t c0, const int kind,
                                      const int pdt, const int buckets, const int markstein, const int clamp) {
    int64_t j = j0;
    for (; j + 64 * PASS2_GROUPS <= j1; j += 64 * PASS2_GROUPS)
        pass2_vbmi_groups(a, vt, base, j, j0, buf, denom, amag, s, col_root, row_root, c0, kind, pdt, buckets,
                          markstein, clamp, PASS2_GROUPS);
    for (; j + 64 <= j1; j += 64)
        pass2_vbmi_groups(a, vt, base, j, j0, buf, denom, amag, s, col_root, row_root, c0, kind, pdt, buckets,
                          markstein, clamp, 1);
    pass2_avx512(a, base, j, j1, buf, denom, amag, s, col_root, row_root, c0 + (j - j0));
}
TV static void pass2_vbmi(const gefen_step_args *a, const vbmi_tables *vt, int64_t base, int64_t j0, int64_t j1,
                          const float *buf, float denom, float amag, float s, const float *col_root, float row_root,
                          int64_t c0) {
    /* u = m / denom by Markstein's correction where denom allows it (a compile-time branch of the loop). Every
     * |u| <= 1 unless the block's max |m| was NaN (then denom = 1): only then are the buckets clamped. */
    const int markstein = denom >= 0x1p-64f && denom <= 0x1p64f, clamp = !(amag >= 0.0f);
#define P2(kind, pdt, nb)                                                                                              \
    do {                                                                                                               \
        if (clamp)                                                                                                     \
            pass2_vbmi_body(a, vt, base, j0, j1, buf, denom, amag, s, col_root, row_root, c0, kind, pdt, nb, 0, 1);    \
        else if (markstein)                                                                                            \
            pass2_vbmi_body(a, vt, base, j0, j1, buf, denom, amag, s, col_root, row_root, c0, kind, pdt, nb, 1, 0);    \
        else                                                                                                           \
            pass2_vbmi_body(a, vt, base, j0, j1, buf, denom, amag, s, col_root, row_root, c0, kind, pdt, nb, 0, 0);    \
    } while (0)
#define P2_NB(kind, pdt)                                                                                               \
    do {                                                                                                               \
        if (vt->buckets == 256) P2(kind, pdt, 256);                                                                    \
        else if (vt->buckets == 512) P2(kind, pdt, 512);                                                               \
        else P2(kind, pdt, 1024);                                                                                      \
    } while (0)
    DISPATCH_KIND_DTYPE(a, P2_NB);
#undef P2_NB
#undef P2
}
#endif /* GEFEN_X86 */
