/*
 * Gefen native CPU kernels: one Gefen step (block-shared or factored second moment) and GefenMuon's quantized
 * momentum, for fp32/bf16/fp16 parameters and gradients, with run-time dispatch on the CPU's features
 * (AVX-512, AVX2+FMA+F16C, portable scalar C).
 *
 * A plain shared library: no Python C-API, no torch C++ ABI. Python (gefen.kernels.native) passes data pointers
 * and one typed record of per-step scalars through ctypes. Threads come from the process's own OpenMP runtime
 * (torch's): Python hands over the addresses of GOMP_parallel / omp_get_thread_num / omp_get_num_threads, so no
 * second OpenMP runtime is ever loaded.
 *
 * Rounding rules (those of the eager torch reference, gefen.kernels.reference, documented there):
 *   - every intermediate is fp32; gradients are up-cast exactly; parameters are written once, round to nearest even;
 *   - first moment:  m_old = c[idx] * a_old;  d = g - m_old;
 *                    m = fma(w, d, m_old)   if w < 0.5  (torch's lerp), else  m = fma(w - 1, d, g);
 *                    a = max|m| (NaN propagates);  u = m / a (true division; u = m / 1 when a is not > 0);
 *                    idx = lut[clamp(trunc((u + 1) * 2048), 0, 4095)] + #{thresholds passed}  (exact §4.8 rule);
 *                    m_hat = c[idx] * a;
 *   - parameter:     p = fma(d, step, p * decay)  with d = m_hat * s (block) or m_hat / (row*col + eps) (factored).
 * Codes and magnitudes are therefore bit-identical to the reference; second moments use another summation order
 * (within a few ulps), which each ISA keeps fixed: results do not depend on the thread count.
 *
 * The file is compiled with -ffp-contract=off: every fused multiply-add is written out.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#define GEFEN_X86 1
#include <immintrin.h>
#else
#define GEFEN_X86 0
#endif

#define GEFEN_ABI_VERSION 6

#define INLINE __attribute__((always_inline)) inline
/* Fully unrolls the four 16-lane steps of a 64-element group, so their vectors stay in registers (GCC at -O2 keeps
 * such loops rolled and the arrays they fill in memory). */
#if defined(__clang__)
#define UNROLL4 _Pragma("clang loop unroll(full)")
#elif defined(__GNUC__)
#define UNROLL4 _Pragma("GCC unroll 4")
#else
#define UNROLL4
#endif
/* CALL(kind, param dtype) with both as compile-time constants, for the specialised pass-2 bodies (the momentum
 * kind writes no parameter: fp32). */
#define DISPATCH_KIND_DTYPE(a, CALL)                                                                                   \
    do {                                                                                                               \
        if ((a)->kind == KIND_MOMENTUM) CALL(KIND_MOMENTUM, DT_F32);                                                   \
        else if ((a)->kind == KIND_FACTORED) {                                                                         \
            if ((a)->param_dtype == DT_F32) CALL(KIND_FACTORED, DT_F32);                                               \
            else if ((a)->param_dtype == DT_BF16) CALL(KIND_FACTORED, DT_BF16);                                        \
            else CALL(KIND_FACTORED, DT_F16);                                                                          \
        } else if ((a)->param_dtype == DT_F32) CALL(KIND_BLOCK, DT_F32);                                               \
        else if ((a)->param_dtype == DT_BF16) CALL(KIND_BLOCK, DT_BF16);                                               \
        else CALL(KIND_BLOCK, DT_F16);                                                                                 \
    } while (0)

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };
enum { KIND_BLOCK = 0, KIND_FACTORED = 1, KIND_MOMENTUM = 2 };
enum { LEVEL_SCALAR = 0, LEVEL_AVX2 = 1, LEVEL_AVX512 = 2, LEVEL_VBMI = 3 };
enum { OK = 0, ERR_ARGS = -1, ERR_NOMEM = -2, ERR_REDUCE = -3, ERR_UNUSABLE = -5 };

/* The argument record. Must match gefen/kernels/native.py (StepArgs) field by field. */
typedef struct {
    void *param;              /* (N,) parameter, param_dtype; unused for KIND_MOMENTUM */
    const void *grad;         /* (N,) gradient, grad_dtype, contiguous */
    uint8_t *codes;           /* (N,) uint8 codes, updated */
    float *scale;             /* (B,) fp32 magnitudes, updated */
    float *v;                 /* (B,) fp32 block second moment, updated (KIND_BLOCK) */
    float *v_row;             /* (R,) fp32 (KIND_FACTORED) */
    float *v_col;             /* (C,) fp32 (KIND_FACTORED) */
    float *out;               /* (N,) fp32 m_hat output (KIND_MOMENTUM) */
    const float *codebook;    /* (256,) fp32 */
    const int32_t *lut;       /* (4097,) int32 bucket table */
    const float *thresholds;  /* (K - 1 + steps,) fp32, +inf padded */
    int64_t numel, period, rows, cols;
    int64_t param_dtype, grad_dtype, steps, lerp_high, kind, threads;
    float w;                  /* EMA weight 1 - beta1 (Muon: 1 - momentum) */
    float beta2, one_minus_beta2, eps;
    float decay;              /* 1 - lr * weight_decay */
    float step;               /* block: -lr;  factored: -lr / bc1 */
    float root_bc2;           /* block: sqrt(bc2) rounded to fp32 (the step divides by it as torch does) */
    float inv_bc1;            /* block: 1 / bc1 */
    float bc2;                /* factored: 1 - beta2^t */
    float grad_bound;         /* > 0: the step is refused (ERR_UNUSABLE, nothing changed) when a gradient value is
                                 NaN or |g| > grad_bound (fp32 compare); 0: not checked */
    int64_t global_rows;      /* factored, row-sharded (FSDP2): the parameter's rows on all ranks; 0: not sharded */
    int64_t reduce_offset;    /* factored, row-sharded: where its column sums and row-moment total go in the
                                 buffer of gefen_step_many_reduce (C + 1 doubles) */
    int64_t *counter;         /* optional (0: none): the parameter's step counter, incremented once the step of
                                 every record has been applied (never on an error return) */
} gefen_step_args;

/* ------------------------------------------------------------------ threading (the process's OpenMP runtime) */
typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*omp_int_fn)(void);
static gomp_parallel_fn g_parallel = 0;
static omp_int_fn g_thread_num = 0;
static omp_int_fn g_num_threads = 0;

void gefen_set_threading(void *parallel, void *thread_num, void *num_threads) {
    g_parallel = (gomp_parallel_fn)parallel;
    g_thread_num = (omp_int_fn)thread_num;
    g_num_threads = (omp_int_fn)num_threads;
}

typedef void (*task_fn)(const void *ctx, int64_t task, int64_t thread);
typedef struct {
    task_fn fn;
    const void *ctx;
    int64_t tasks;
    const int64_t *cost; /* (tasks + 1,) cumulative cost of the tasks (elements), or NULL: equal costs */
} pool_job;

/* First task whose cumulative cost reaches `target` (cost is non-decreasing). */
static int64_t first_reaching(const int64_t *cost, int64_t tasks, int64_t target) {
    int64_t lo = 0, hi = tasks;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (cost[mid] < target) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* Thread k of n takes a contiguous range of tasks: equal counts, or equal costs when costs are given. */
static void task_range(const pool_job *job, int64_t k, int64_t n, int64_t *lo, int64_t *hi) {
    if (!job->cost) {
        *lo = job->tasks * k / n;
        *hi = job->tasks * (k + 1) / n;
        return;
    }
    const int64_t total = job->cost[job->tasks];
    *lo = k == 0 ? 0 : first_reaching(job->cost, job->tasks, total / n * k + total % n * k / n);
    *hi = k == n - 1 ? job->tasks
                     : first_reaching(job->cost, job->tasks, total / n * (k + 1) + total % n * (k + 1) / n);
}

static void pool_worker(void *data) {
    const pool_job *job = (const pool_job *)data;
    int64_t n = g_num_threads(), k = g_thread_num(), lo, hi;
    task_range(job, k, n, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) job->fn(job->ctx, t, k);
}

/* Run fn(ctx, t, thread) for t in [0, tasks) on at most `threads` threads (thread < threads), each thread taking
 * a contiguous range of about equal cost (cost: cumulative, (tasks + 1,), or NULL for equal tasks). Every task is
 * independent, so the result never depends on the threads. */
static void parallel_for_cost(int64_t tasks, int64_t threads, task_fn fn, const void *ctx, const int64_t *cost) {
    if (threads > tasks) threads = tasks;
    if (threads <= 1 || !g_parallel) {
        for (int64_t t = 0; t < tasks; t++) fn(ctx, t, 0);
        return;
    }
    pool_job job = {fn, ctx, tasks, cost};
    g_parallel(pool_worker, &job, (unsigned)threads, 0);
}

/* ------------------------------------------------------------------ scalar conversions */
static inline float bits_f(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t f_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

static inline float bf16_to_f32(uint16_t h) { return bits_f((uint32_t)h << 16); }
static inline uint16_t f32_to_bf16(float f) {
    uint32_t b = f_bits(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN, as torch */
    return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t v = (uint32_t)(h & 0x7fffu) << 13;
    uint32_t exp = v & 0x0f800000u;
    v += (uint32_t)(127 - 15) << 23;
    if (exp == 0x0f800000u) {
        v += (uint32_t)(128 - 16) << 23; /* inf / NaN */
    } else if (exp == 0) {               /* zero / subnormal */
        v += 1u << 23;
        v = f_bits(bits_f(v) - bits_f(113u << 23));
    }
    return bits_f(v | sign);
}
static inline uint16_t f32_to_f16(float f) {
    uint32_t x = f_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint16_t o;
    x &= 0x7fffffffu;
    if (x >= 0x47800000u) {                 /* >= 65536 (or inf / NaN) */
        o = (x > 0x7f800000u) ? 0x7e00 : 0x7c00;
    } else if (x < 0x38800000u) {           /* below the smallest normal half: exact RNE by float addition */
        float r = bits_f(x) + 0.5f;
        o = (uint16_t)(f_bits(r) - f_bits(0.5f));
    } else {
        uint32_t odd = (x >> 13) & 1u;
        x += ((uint32_t)(15 - 127) << 23) + 0xfffu;
        x += odd;
        o = (uint16_t)(x >> 13);
    }
    return (uint16_t)(o | sign);
}

static inline float load1(const void *p, int64_t i, int64_t dt) {
    if (dt == DT_F32) return ((const float *)p)[i];
    if (dt == DT_BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
    return f16_to_f32(((const uint16_t *)p)[i]);
}
static inline void store1(void *p, int64_t i, int64_t dt, float x) {
    if (dt == DT_F32) ((float *)p)[i] = x;
    else if (dt == DT_BF16) ((uint16_t *)p)[i] = f32_to_bf16(x);
    else ((uint16_t *)p)[i] = f32_to_f16(x);
}

/* ------------------------------------------------------------------ one element (scalar path and vector tails) */
static inline float ema1(const gefen_step_args *a, float m_old, float g) {
    float d = g - m_old;
    return a->lerp_high ? fmaf(a->w - 1.0f, d, g) : fmaf(a->w, d, m_old);
}
static inline int32_t nearest1(const gefen_step_args *a, float u) {
    float t = (u + 1.0f) * 2048.0f;
    int32_t b = (t >= 1.0f) ? ((t < 4095.0f) ? (int32_t)t : 4095) : 0; /* NaN -> 0 */
    int32_t idx = a->lut[b];
    for (int64_t s = 0; s < a->steps; s++) idx += a->thresholds[idx] < u;
    return idx;
}
/* The quantized moment and the parameter write of element j of a block (m already in buf[j]). */
static inline void finish1(const gefen_step_args *a, int64_t e, float m, float inv_denom_a, float amag,
                           float s, const float *col_root, float row_root, int64_t c) {
    float u = m / inv_denom_a;
    int32_t idx = nearest1(a, u);
    a->codes[e] = (uint8_t)idx;
    float m_hat = a->codebook[idx] * amag;
    if (a->kind == KIND_MOMENTUM) {
        a->out[e] = m_hat;
        return;
    }
    float d = (a->kind == KIND_FACTORED) ? m_hat / (row_root * col_root[c] + a->eps) : m_hat * s;
    float p = load1(a->param, e, a->param_dtype) * a->decay;
    store1(a->param, e, a->param_dtype, fmaf(d, a->step, p));
}

/* ------------------------------------------------------------------ per-block driver, shared by every ISA */
typedef struct vbmi_tables vbmi_tables;

/* Bucket entries for a search with one compare (the AVX2 pass 2): `buckets` uniform buckets over [-1, 1]
 * (b = clamp(trunc((u + 1) * buckets / 2), 0, buckets - 1) in fp32, a monotone function of u), chosen as the fewest
 * (256 .. 4096) for which no bucket holds more than one threshold below 1. Entry b is 4 fp32 slots: the first
 * threshold not in an earlier bucket t[k] (+inf past the last), c[k], c[k + 1] (c[255] for k = 255) and k as int32
 * bits, where k = the number of thresholds in earlier buckets. For u in bucket b the nearest code is
 * k + (t[k] < u): a threshold of a later bucket is above u, one at or above 1 is never below u. So one 16-byte load
 * per element replaces the bucket look-up, the threshold look-up and the codebook look-up of m_hat. */
typedef struct {
    float *entry; /* (buckets, 4), 16-byte aligned */
    int64_t buckets;
} entry_table;

typedef struct {
    const gefen_step_args *a;
    const float *row_root, *col_root;
    int64_t blocks_per_task;
    int level;
    const vbmi_tables *vt;  /* LEVEL_VBMI only */
    const entry_table *et; /* LEVEL_AVX2 only, when one compare suffices */
    float *bufs;           /* one block buffer of buf_stride floats per thread */
    int64_t buf_stride;
} block_ctx;

/* Pass 1 over a whole block [base, base + P): m into buf[0..P), returns max|m| (NaN-propagating) and stores the sum
 * of g^2 in *sq. The sum has one order on every ISA: 16 lanes (lane l takes the elements j < P - P % 16 with
 * j % 16 == l, each by fma), the lanes added in order 0..15, then the last P % 16 elements one by one (fma). */
typedef float (*pass1_fn)(const gefen_step_args *, int64_t base, int64_t P, float a_old, float *buf, float *sq);
/* pass 2 over [j0, j1) of block b (one row segment when factored) */
typedef void (*pass2_fn)(const gefen_step_args *, int64_t base, int64_t j0, int64_t j1, const float *buf,
                         float denom, float amag, float s, const float *col_root, float row_root, int64_t c0);

/* Elements [j0, P) one by one: m into buf, max|m| and NaN into mx and nan, g^2 added to total in order. */
static void pass1_tail(const gefen_step_args *a, int64_t base, int64_t j0, int64_t P, float a_old, float *buf,
                       float *total, float *mx, int *nan) {
    for (int64_t j = j0; j < P; j++) {
        float g = load1(a->grad, base + j, a->grad_dtype);
        float m = ema1(a, a->codebook[a->codes[base + j]] * a_old, g);
        buf[j] = m;
        float am = fabsf(m);
        if (am != am) *nan = 1;
        else if (am > *mx) *mx = am;
        *total = fmaf(g, g, *total);
    }
}

static inline float sum16(const float lanes[16]) {
    float total = 0.0f;
    for (int k = 0; k < 16; k++) total += lanes[k];
    return total;
}

static float pass1_scalar(const gefen_step_args *a, int64_t base, int64_t P, float a_old, float *buf, float *sq) {
    float lanes[16] = {0}, mx = 0.0f;
    int nan = 0;
    const int64_t full = P - P % 16;
    for (int64_t j = 0; j < full; j++) {
        float g = load1(a->grad, base + j, a->grad_dtype);
        float m = ema1(a, a->codebook[a->codes[base + j]] * a_old, g);
        buf[j] = m;
        float am = fabsf(m);
        if (am != am) nan = 1;
        else if (am > mx) mx = am;
        lanes[j & 15] = fmaf(g, g, lanes[j & 15]);
    }
    float total = sum16(lanes);
    pass1_tail(a, base, full, P, a_old, buf, &total, &mx, &nan);
    *sq = total;
    return nan ? NAN : mx;
}

static void pass2_scalar(const gefen_step_args *a, int64_t base, int64_t j0, int64_t j1, const float *buf,
                         float denom, float amag, float s, const float *col_root, float row_root, int64_t c0) {
    for (int64_t j = j0; j < j1; j++) finish1(a, base + j, buf[j], denom, amag, s, col_root, row_root, c0 + (j - j0));
}

/* Bucket of u among nb uniform buckets over [-1, 1] (fp32 arithmetic as in every vector path; NaN -> 0). */
static inline int64_t bucket_of(float u, int64_t nb) {
    float t = (u + 1.0f) * (float)(nb / 2);
    return (t >= 1.0f) ? ((t < (float)(nb - 1)) ? (int64_t)t : nb - 1) : 0;
}

/* The entry table of a codebook (see entry_table), or 0 when more than one compare would be needed with 4096
 * buckets, or on allocation failure (*nomem set): the callers then use the gather path. */
static entry_table *make_entry_table(const gefen_step_args *a, int *nomem) {
    float thr[256];
    for (int i = 0; i < 256; i++) thr[i] = (i < 255 + a->steps) ? a->thresholds[i] : INFINITY;
    for (int64_t nb = 256; nb <= 4096; nb *= 2) {
        int32_t count[4096] = {0};
        int most = 0;
        for (int i = 0; i < 255; i++)
            if (thr[i] < 1.0f && ++count[bucket_of(thr[i], nb)] > most) most = count[bucket_of(thr[i], nb)];
        if (most > 1) continue;
        entry_table *et = (entry_table *)malloc(sizeof(entry_table));
        float *entry = (float *)aligned_alloc(64, (size_t)nb * 4 * sizeof(float));
        if (!et || !entry) {
            free(et);
            free(entry);
            *nomem = 1;
            return 0;
        }
        int32_t k = 0;
        for (int64_t b = 0; b < nb; b++) {
            while (k < 255 && bucket_of(thr[k], nb) < b) k++;
            entry[4 * b] = thr[k];
            entry[4 * b + 1] = a->codebook[k];
            entry[4 * b + 2] = a->codebook[k < 255 ? k + 1 : 255];
            memcpy(&entry[4 * b + 3], &k, 4);
        }
        et->entry = entry;
        et->buckets = nb;
        return et;
    }
    return 0;
}

static void free_entry_table(entry_table *et) {
    if (et) free(et->entry);
    free(et);
}

#if GEFEN_X86
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

T2 static float pass1_avx2(const gefen_step_args *a, int64_t base, int64_t P, float a_old, float *buf, float *sq) {
    const __m256 vw = _mm256_set1_ps(a->lerp_high ? a->w - 1.0f : a->w), vold = _mm256_set1_ps(a_old);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 mx = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}; /* lanes 0-7 and 8-15 */
    const int64_t full = P - P % 16;
    for (int64_t j = 0; j < full; j += 8) {
        __m256 g = ld8(a->grad, base + j, a->grad_dtype);
        __m256 mo = _mm256_mul_ps(decode8(a->codebook, a->codes + base + j), vold);
        __m256 d = _mm256_sub_ps(g, mo);
        __m256 m = _mm256_fmadd_ps(vw, d, a->lerp_high ? g : mo);
        _mm256_storeu_ps(buf + j, m);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(m, m, _CMP_UNORD_Q));
        mx = _mm256_max_ps(mx, _mm256_and_ps(m, absmask));
        acc[(j >> 3) & 1] = _mm256_fmadd_ps(g, g, acc[(j >> 3) & 1]);
    }
    float lanes[16], maxes[8], m_out = 0.0f;
    _mm256_storeu_ps(lanes, acc[0]);
    _mm256_storeu_ps(lanes + 8, acc[1]);
    _mm256_storeu_ps(maxes, mx);
    for (int k = 0; k < 8; k++)
        if (maxes[k] > m_out) m_out = maxes[k];
    int has_nan = _mm256_movemask_ps(nan) != 0;
    float total = sum16(lanes);
    pass1_tail(a, base, full, P, a_old, buf, &total, &m_out, &has_nan);
    *sq = total;
    return has_nan ? NAN : m_out;
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

/* Pass 2 with the entry table: per 8 elements 8 16-byte loads and a 4x4 transpose instead of 3 gathers. */
T2 static INLINE void pass2_avx2e_body(const gefen_step_args *a, const entry_table *et, int64_t base, int64_t j0,
                                       int64_t j1, const float *buf, float denom, float amag, float s,
                                       const float *col_root, float row_root, int64_t c0, const int kind,
                                       const int pdt) {
    const float *entry = et->entry;
    const __m256 vden = _mm256_set1_ps(denom), vmag = _mm256_set1_ps(amag), vs = _mm256_set1_ps(s);
    const int markstein = denom >= 0x1p-64f && denom <= 0x1p64f;
    const __m256 vinv = _mm256_set1_ps(1.0f / denom), one = _mm256_set1_ps(1.0f);
    const __m256 vrow = _mm256_set1_ps(row_root), veps = _mm256_set1_ps(a->eps);
    const __m256 vdecay = _mm256_set1_ps(a->decay), vstep = _mm256_set1_ps(a->step);
    const __m256 half = _mm256_set1_ps((float)(et->buckets / 2));
    const __m256i last = _mm256_set1_epi32((int)et->buckets - 1), zero = _mm256_setzero_si256();
    uint8_t *const codes = a->codes;
    int64_t j = j0;
    for (; j + 8 <= j1; j += 8) {
        const int64_t e = base + j;
        __m256 u = quotient8(_mm256_loadu_ps(buf + j), vden, vinv, markstein);
        __m256i b = _mm256_cvttps_epi32(_mm256_mul_ps(_mm256_add_ps(u, one), half));
        b = _mm256_min_epi32(_mm256_max_epi32(b, zero), last); /* NaN / overflow -> INT_MIN -> 0 */
        int32_t bi[8];
        _mm256_storeu_si256((__m256i *)bi, b);
#define ENTRY_PAIR(k) \
    _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_load_ps(entry + 4 * bi[k])), _mm_load_ps(entry + 4 * bi[k + 4]), 1)
        const __m256 r0 = ENTRY_PAIR(0), r1 = ENTRY_PAIR(1), r2 = ENTRY_PAIR(2), r3 = ENTRY_PAIR(3);
#undef ENTRY_PAIR
        __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
        __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
        __m256 th = _mm256_shuffle_ps(t0, t2, 0x44), lo = _mm256_shuffle_ps(t0, t2, 0xEE);
        __m256 hi = _mm256_shuffle_ps(t1, t3, 0x44), k0 = _mm256_shuffle_ps(t1, t3, 0xEE);
        __m256 pass = _mm256_cmp_ps(th, u, _CMP_LT_OQ);
        __m256i idx = _mm256_sub_epi32(_mm256_castps_si256(k0), _mm256_castps_si256(pass));
        __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(idx), _mm256_extracti128_si256(idx, 1));
        _mm_storel_epi64((__m128i *)(codes + e), _mm_packus_epi16(w, w));
        __m256 m_hat = _mm256_mul_ps(_mm256_blendv_ps(lo, hi, pass), vmag);
        if (kind == KIND_MOMENTUM) {
            _mm256_storeu_ps(a->out + e, m_hat);
            continue;
        }
        __m256 d;
        if (kind == KIND_FACTORED) {
            __m256 den = _mm256_add_ps(_mm256_mul_ps(vrow, _mm256_loadu_ps(col_root + c0 + (j - j0))), veps);
            d = _mm256_div_ps(m_hat, den);
        } else {
            d = _mm256_mul_ps(m_hat, vs);
        }
        __m256 p = _mm256_mul_ps(ld8(a->param, e, pdt), vdecay);
        st8(a->param, e, pdt, _mm256_fmadd_ps(d, vstep, p));
    }
    pass2_scalar(a, base, j, j1, buf, denom, amag, s, col_root, row_root, c0 + (j - j0));
}
T2 static void pass2_avx2e(const gefen_step_args *a, const entry_table *et, int64_t base, int64_t j0, int64_t j1,
                           const float *buf, float denom, float amag, float s, const float *col_root, float row_root,
                           int64_t c0) {
#define P2E(kind, pdt) pass2_avx2e_body(a, et, base, j0, j1, buf, denom, amag, s, col_root, row_root, c0, kind, pdt)
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

/* The scale of the byte-shuffle buckets: the float just below nb / 2, so that u in [-1, 1] falls in bucket
 * trunc(fma(u, H, H)) in [0, nb - 1] with no clamp (u = 1 gives 2H < nb). */
static inline float vbmi_half(int64_t nb) { return nextafterf((float)(nb / 2), 0.0f); }
/* The bucket of u (clamped: the table builder's and the clamping pass's rule; NaN -> 0). */
static inline int64_t vbmi_bucket(float u, int64_t nb) {
    const float h = vbmi_half(nb), t = fmaf(u, h, h);
    return (t >= 1.0f) ? ((t < (float)(nb - 1)) ? (int64_t)t : nb - 1) : 0;
}

/* A bucket table of its own for the byte-shuffle search: `buckets` uniform buckets (chosen per codebook for the
 * fewest shuffles: a larger table costs 4 more per 256 entries, each compare step about 22), base[b] = number of
 * thresholds whose bucket (vbmi_bucket) is below b. Any monotone bucket function gives the exact rule (see
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
            int64_t b = vbmi_bucket(thr[i], nb);
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
            while (i < 255 && vbmi_bucket(thr[i], nb) < b) i++;
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

/* Software prefetch distance of the streams (gradient, codes, parameter), in elements ahead. */
#ifndef PREFETCH_ELEMENTS
#define PREFETCH_ELEMENTS 1024
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
            _mm_prefetch((const char *)(codes + j + PREFETCH_ELEMENTS), _MM_HINT_T0);
            lookup64(&vt->codebook, perm64(_mm512_loadu_si512((const void *)(codes + j))), &c[0], &c[1], &c[2],
                     &c[3]);
        }
        UNROLL4
        for (int k = 0; k < 4; k++) {
            _mm_prefetch(grad + (j + 16 * k + PREFETCH_ELEMENTS) * (gdt == DT_F32 ? 4 : 2), _MM_HINT_T0);
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
    switch (a->grad_dtype * 2 + high) {
    case DT_F32 * 2: P1(DT_F32, 0);
    case DT_F32 * 2 + 1: P1(DT_F32, 1);
    case DT_BF16 * 2: P1(DT_BF16, 0);
    case DT_BF16 * 2 + 1: P1(DT_BF16, 1);
    case DT_F16 * 2: P1(DT_F16, 0);
    default: P1(DT_F16, 1);
    }
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

/* m / den for den > 0: reciprocal estimate, one Newton step and Markstein's correction of the quotient: the
 * correctly rounded quotient except within a few units of the 2^-28 error of the reciprocal (then one ulp off). */
TV static inline __attribute__((always_inline)) __m512 divide16(__m512 m, __m512 den) {
    __m512 y = _mm512_rcp14_ps(den);
    y = _mm512_mul_ps(y, _mm512_fnmadd_ps(den, y, _mm512_set1_ps(2.0f)));
    __m512 q = _mm512_mul_ps(m, y);
    return _mm512_fmadd_ps(_mm512_fnmadd_ps(q, den, m), y, q);
}

TV static INLINE void pass2_vbmi_body(const gefen_step_args *a, const vbmi_tables *vt, int64_t base, int64_t j0,
                                      int64_t j1, const float *buf, float denom, float amag, float s,
                                      const float *col_root, float row_root, int64_t c0, const int kind,
                                      const int pdt, const int buckets, const int markstein, const int clamp) {
    uint8_t *const codes = a->codes;
    float *const out = a->out;
    void *const param = a->param;
    const int64_t steps = vt->steps;
    const __m512 vden = _mm512_set1_ps(denom), vmag = _mm512_set1_ps(amag), vs = _mm512_set1_ps(s);
    const __m512 vinv = _mm512_set1_ps(1.0f / denom);
    const __m512 vrow = _mm512_set1_ps(row_root), veps = _mm512_set1_ps(a->eps);
    const __m512 vdecay = _mm512_set1_ps(a->decay), vstep = _mm512_set1_ps(a->step);
    const __m512i zero = _mm512_setzero_si512(), ones8 = _mm512_set1_epi8(1), twos8 = _mm512_set1_epi8(2);
    const __m512 half = _mm512_set1_ps(vbmi_half(buckets));
    const __m512i last = _mm512_set1_epi32(buckets - 1), byte = _mm512_set1_epi16(255);
    int64_t j = j0;
    for (; j + 64 <= j1; j += 64) {
        __m512 u[4];
        __m512i b[4];
        UNROLL4
        for (int k = 0; k < 4; k++) {
            u[k] = quotient16(_mm512_loadu_ps(buf + j + 16 * k), vden, vinv, markstein);
            b[k] = _mm512_cvttps_epi32(_mm512_fmadd_ps(u[k], half, half)); /* |u| <= 1: [0, buckets); NaN: INT_MIN */
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
        __m512i idx = bytes256(vt->base[0], key);
        if (buckets >= 512) idx = _mm512_mask_blend_epi8(hi8, idx, bytes256(vt->base[1], key));
        if (buckets >= 1024) {
            __m512i upper = _mm512_mask_blend_epi8(hi8, bytes256(vt->base[2], key), bytes256(vt->base[3], key));
            idx = _mm512_mask_blend_epi8(hi9, idx, upper);
        }
        for (int64_t st = 0; st < steps; st++) {
            __m512 t[4];
            lookup64(&vt->thresholds, perm64(idx), &t[0], &t[1], &t[2], &t[3]);
            __mmask16 pass[4];
            UNROLL4
            for (int k = 0; k < 4; k++) pass[k] = _mm512_cmp_ps_mask(t[k], u[k], _CMP_LT_OQ);
            idx = _mm512_mask_add_epi8(idx, join4(pass), idx, ones8);
        }
        _mm512_storeu_si512((void *)(codes + base + j), idx);
        __m512 c[4];
        lookup64(&vt->codebook, perm64(idx), &c[0], &c[1], &c[2], &c[3]);
        UNROLL4
        for (int k = 0; k < 4; k++) {
            const int64_t e = base + j + 16 * k;
            __m512 m_hat = _mm512_mul_ps(c[k], vmag);
            if (kind == KIND_MOMENTUM) {
                _mm512_storeu_ps(out + e, m_hat);
                continue;
            }
            __m512 d;
            if (kind == KIND_FACTORED) {
                __m512 den =
                    _mm512_add_ps(_mm512_mul_ps(vrow, _mm512_loadu_ps(col_root + c0 + (j - j0) + 16 * k)), veps);
                d = divide16(m_hat, den);
            } else {
                d = _mm512_mul_ps(m_hat, vs);
            }
            _mm_prefetch((const char *)param + (e + PREFETCH_ELEMENTS) * (pdt == DT_F32 ? 4 : 2), _MM_HINT_T0);
            __m512 p = _mm512_mul_ps(ld16(param, e, pdt), vdecay);
            st16(param, e, pdt, _mm512_fmadd_ps(d, vstep, p));
        }
    }
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

/* ------------------------------------------------------------------ CPU level */
static int g_forced_level = -1;

int gefen_cpu_level(void) {
#if GEFEN_X86 && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    /* DQ: vrangeps (VBMI pass 1) and the period and k-means paths; every AVX-512 CPU with BW and VL has it */
    int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                 __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (avx512 && __builtin_cpu_supports("avx512vbmi")) return LEVEL_VBMI;
    if (avx512) return LEVEL_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return LEVEL_AVX2;
#endif
    return LEVEL_SCALAR;
}

/* Use at most `level` (tests run every path a CPU supports); -1 restores the best level. Returns the level used. */
int gefen_force_level(int level) {
    int best = gefen_cpu_level();
    g_forced_level = (level < 0 || level > best) ? -1 : level;
    return g_forced_level < 0 ? best : g_forced_level;
}

static int active_level(void) { return g_forced_level >= 0 ? g_forced_level : gefen_cpu_level(); }

int gefen_abi_version(void) { return GEFEN_ABI_VERSION; }

/* ------------------------------------------------------------------ the block loop */
static void block_task(const void *ctx_, int64_t task, int64_t thread) {
    const block_ctx *ctx = (const block_ctx *)ctx_;
    const gefen_step_args *a = ctx->a;
    const int64_t P = a->period, B = a->numel / P;
    int64_t b0 = task * ctx->blocks_per_task, b1 = b0 + ctx->blocks_per_task;
    if (b1 > B) b1 = B;
    pass1_fn p1 = pass1_scalar;
    pass2_fn p2 = pass2_scalar;
#if GEFEN_X86
    if (ctx->level >= LEVEL_AVX512) {
        p1 = pass1_avx512;
        p2 = pass2_avx512;
    } else if (ctx->level == LEVEL_AVX2) {
        p1 = pass1_avx2;
        p2 = pass2_avx2;
    }
#endif
    float *buf = ctx->bufs + thread * ctx->buf_stride;
#if GEFEN_X86
    const vbmi_tables *vt = ctx->level == LEVEL_VBMI ? ctx->vt : 0;
    const entry_table *et = ctx->level == LEVEL_AVX2 ? ctx->et : 0;
    if (vt) p1 = pass1_avx512; /* the VBMI passes are called directly below */
#else
    const void *vt = 0;
#endif
    for (int64_t b = b0; b < b1; b++) {
        const int64_t base = b * P;
        float sq = 0.0f;
#if GEFEN_X86
        float amag = vt ? pass1_vbmi(a, vt, base, P, a->scale[b], buf, &sq) : p1(a, base, P, a->scale[b], buf, &sq);
#else
        float amag = p1(a, base, P, a->scale[b], buf, &sq);
#endif
        float s = 0.0f;
        if (a->kind == KIND_BLOCK) {
            float mean = sq * (1.0f / (float)P);
            float v = fmaf(mean, a->one_minus_beta2, a->v[b] * a->beta2);
            a->v[b] = v;
            s = (1.0f / (sqrtf(v) * (1.0f / a->root_bc2) + a->eps)) * a->inv_bc1;
        }
        float denom = (amag > 0.0f) ? amag : 1.0f;
        if (a->kind == KIND_FACTORED) {
            const int64_t C = a->cols;
            int64_t j = 0;
            while (j < P) {
                int64_t e = base + j, r = e / C, c = e - r * C;
                int64_t len = C - c < P - j ? C - c : P - j;
                const float row_root = ctx->row_root[r];
#if GEFEN_X86
                if (vt) pass2_vbmi(a, vt, base, j, j + len, buf, denom, amag, s, ctx->col_root, row_root, c);
                else if (et) pass2_avx2e(a, et, base, j, j + len, buf, denom, amag, s, ctx->col_root, row_root, c);
                else
#endif
                    p2(a, base, j, j + len, buf, denom, amag, s, ctx->col_root, row_root, c);
                j += len;
            }
        } else {
#if GEFEN_X86
            if (vt) pass2_vbmi(a, vt, base, 0, P, buf, denom, amag, s, 0, 0.0f, 0);
            else if (et) pass2_avx2e(a, et, base, 0, P, buf, denom, amag, s, 0, 0.0f, 0);
            else
#endif
                p2(a, base, 0, P, buf, denom, amag, s, 0, 0.0f, 0);
        }
        a->scale[b] = amag;
    }
}

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
 * 1 thread: 8192 x 1408 in 2.5 ms one row at a time, 4.9 ms four rows; 4096 x 4096 in 6.4 ms vs 5.0 ms). */
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
T2 static double row_sq_avx2(const gefen_step_args *a, int64_t base, int64_t C, double *col) {
    __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
    int64_t c = 0;
    for (; c + 8 <= C; c += 8) {
        __m256 g = ld8(a->grad, base + c, a->grad_dtype);
        __m256 g2 = _mm256_mul_ps(g, g);
        __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(g2)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(g2, 1));
        s0 = _mm256_add_pd(s0, lo);
        s1 = _mm256_add_pd(s1, hi);
        _mm256_storeu_pd(col + c, _mm256_add_pd(_mm256_loadu_pd(col + c), lo));
        _mm256_storeu_pd(col + c + 4, _mm256_add_pd(_mm256_loadu_pd(col + c + 4), hi));
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(s0, s1));
    return row_sq_scalar_from(a, base, c, C, col, (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]));
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
    }
#endif
    int64_t r = r0;
    if (fn4 && C >= ROWS4_MIN_COLS)
        for (; r + 4 <= r1; r += 4) fn4(a, r * C, C, col, ctx->row_sq + r);
    for (; r < r1; r++) ctx->row_sq[r] = fn(a, r * C, C, col);
}

/* ------------------------------------------------------------------ entry point */
/* Elements per task of the block loop; a fixed number, so the split never depends on the thread count. */
#define TASK_ELEMENTS 32768
/* Below this many elements the step runs on the calling thread (waking the pool costs more). */
#define PARALLEL_MIN_ELEMENTS 65536

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
    for (; i + 8 <= i1; i += 8)
        ok = _mm256_and_ps(ok,
                           _mm256_cmp_ps(_mm256_and_ps(ld8(a->grad, i, a->grad_dtype), absmask), bound, _CMP_LE_OQ));
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

/* Every code index read through the bucket table stays inside the tables: values in [0, 255], non-decreasing. */
static int check_lut(const int32_t *lut) {
    for (int b = 0; b <= 4096; b++)
        if (lut[b] < 0 || lut[b] > 255 || (b > 0 && lut[b] < lut[b - 1])) return ERR_ARGS;
    return OK;
}

/* Refuse a record that could make any routine read or write outside its tensors (before anything changes). */
static int check_args(const gefen_step_args *a) {
    if (!a || a->numel <= 0 || a->period <= 0 || a->numel % a->period != 0) return ERR_ARGS;
    if (a->param_dtype < 0 || a->param_dtype > 2 || a->grad_dtype < 0 || a->grad_dtype > 2) return ERR_ARGS;
    if (a->kind < 0 || a->kind > 2 || a->steps < 0 || a->steps > 255 || !a->codes || !a->scale || !a->grad)
        return ERR_ARGS;
    if (!a->codebook || !a->lut || !a->thresholds || !(a->grad_bound >= 0.0f)) return ERR_ARGS;
    if (a->kind == KIND_BLOCK && (!a->v || !a->param)) return ERR_ARGS;
    if (a->kind == KIND_MOMENTUM && !a->out) return ERR_ARGS;
    if (a->kind == KIND_FACTORED &&
        (!a->v_row || !a->v_col || !a->param || a->rows <= 0 || a->cols <= 0 || a->rows * a->cols != a->numel))
        return ERR_ARGS;
    return OK;
}

/* Everything one parameter's step needs besides its record. */
typedef struct {
    block_ctx ctx;
    stats_ctx sctx;
    int64_t block_tasks, stat_tasks;
    uint8_t *task_ok; /* (stat_tasks,) block / momentum records with grad_bound > 0: 1 when a check task passed */
    float *roots;  /* (R + C,) factored: row roots then column roots (first the updated row moments) */
    double *sums;  /* (R + C + stat_tasks * C,) factored: row sums, column sums, per-task column partials */
    double total;  /* factored: fp64 sum of the updated row moments */
} param_plan;

typedef struct {
    param_plan *plans;
    const int32_t *task_param; /* flat task -> parameter */
    const int64_t *task_local; /* flat task -> that parameter's task */
} flat_ctx;

/* The statistics phase: a factored record's statistics, or a checked record's usability check over
 * TASK_ELEMENTS elements. */
static void flat_stats_task(const void *ctx_, int64_t t, int64_t thread) {
    const flat_ctx *f = (const flat_ctx *)ctx_;
    param_plan *plan = &f->plans[f->task_param[t]];
    const gefen_step_args *a = plan->ctx.a;
    const int64_t task = f->task_local[t];
    if (a->kind == KIND_FACTORED) {
        stats_task(&plan->sctx, task, thread);
        return;
    }
    const int64_t i0 = task * TASK_ELEMENTS, i1 = i0 + TASK_ELEMENTS < a->numel ? i0 + TASK_ELEMENTS : a->numel;
    plan->task_ok[task] = (uint8_t)usable_range(a, i0, i1, plan->ctx.level);
}
static void flat_block_task(const void *ctx_, int64_t t, int64_t thread) {
    const flat_ctx *f = (const flat_ctx *)ctx_;
    block_task(&f->plans[f->task_param[t]].ctx, f->task_local[t], thread);
}

static int64_t count_tasks(const param_plan *plans, int64_t n, int stats) {
    int64_t total = 0;
    for (int64_t i = 0; i < n; i++) total += stats ? plans[i].stat_tasks : plans[i].block_tasks;
    return total;
}

/* Run the tasks of every parameter (stats or block phase) as one parallel loop: one wake-up of the pool. tp and tl
 * hold room for count_tasks(plans, n, stats) entries. */
static void run_flat(param_plan *plans, int64_t n, int stats, int64_t threads, int32_t *tp, int64_t *tl,
                     int64_t *cost) {
    int64_t k = 0;
    cost[0] = 0;
    for (int64_t i = 0; i < n; i++) {
        const gefen_step_args *a = plans[i].ctx.a;
        int64_t m = stats ? plans[i].stat_tasks : plans[i].block_tasks;
        for (int64_t t = 0; t < m; t++, k++) {
            tp[k] = (int32_t)i;
            tl[k] = t;
            int64_t elements;
            if (stats && a->kind != KIND_FACTORED) {
                elements = (t + 1) * TASK_ELEMENTS < a->numel ? TASK_ELEMENTS : a->numel - t * TASK_ELEMENTS;
            } else if (stats) {
                int64_t r0 = t * plans[i].sctx.rows_per_task, r1 = r0 + plans[i].sctx.rows_per_task;
                elements = ((r1 < a->rows ? r1 : a->rows) - r0) * a->cols;
            } else {
                int64_t blocks = a->numel / a->period, b0 = t * plans[i].ctx.blocks_per_task;
                int64_t b1 = b0 + plans[i].ctx.blocks_per_task;
                elements = ((b1 < blocks ? b1 : blocks) - b0) * a->period;
            }
            cost[k + 1] = cost[k] + elements;
        }
    }
    if (k == 0) return;
    flat_ctx f = {plans, tp, tl};
    parallel_for_cost(k, threads, stats ? flat_stats_task : flat_block_task, &f, cost);
}

/* The factored second moment of one parameter, part 1: its column sums of g^2 (this rank's rows) into col_sq, the
 * updated row moments into the row-root slots (published by factored_roots) and their fp64 total. */
static double factored_sums(const gefen_step_args *a, param_plan *plan) {
    const int64_t R = a->rows, C = a->cols;
    float *v_row_new = plan->roots;
    double *row_sq = plan->sums, *col_sq = plan->sums + R, *part = plan->sums + R + C;
    memset(col_sq, 0, (size_t)C * sizeof(double));
    for (int64_t t = 0; t < plan->stat_tasks; t++)
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
static void factored_roots(const gefen_step_args *a, param_plan *plan, double total, int64_t R_all) {
    const int64_t R = a->rows, C = a->cols;
    float *row_root = plan->roots, *col_root = plan->roots + R;
    const double *col_sq = plan->sums + R;
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

static void free_plans(param_plan *plans, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        free(plans[i].task_ok);
        free(plans[i].roots);
        free(plans[i].sums);
    }
    free(plans);
}

/* Sums every rank's (C + 1)-double pieces of a reduce buffer in place (an all-reduce); returns 0 on success. */
typedef int (*gefen_reduce_fn)(double *buffer, int64_t length);

/* The reduce of a rank that fails before it: it still takes part (so no rank waits on it), its status slot set. */
static int fail_before_reduce(int rc, double *buffer, int64_t length, gefen_reduce_fn reduce) {
    if (length > 0) {
        buffer[length - 1] = 1.0;
        reduce(buffer, length);
    }
    return rc;
}

/* One step of n parameters (records args[0..n)), all of whose tasks share two parallel loops. Every record is
 * checked and every buffer allocated before the first write: an error return has changed nothing.
 * Row-sharded factored records (global_rows > 0) put their column sums and row-moment totals into `buffer` at their
 * reduce_offset (C + 1 doubles each, within buffer[0, length - 1)), `reduce` sums the buffer over the ranks in
 * place, and their moments use the all-rank sums. The last slot is a status: every rank calls `reduce` exactly
 * once when length > 0 (also with no such record of its own, and also when it fails before the reduce, with the
 * slot set), and a non-zero sum refuses the step on every rank with nothing changed.
 * Records with grad_bound > 0 are checked after the statistics (see usable_range): when one fails, the call returns
 * ERR_UNUSABLE with nothing changed and, if `unusable` is given (n bytes), sets unusable[i] = 1 for each failing
 * record i (0 for the others). */
int gefen_step_many_reduce(const gefen_step_args *args, int64_t n, double *buffer, int64_t length,
                           gefen_reduce_fn reduce, uint8_t *unusable) {
    if (length < 0 || (length > 0 && (!buffer || !reduce))) return ERR_ARGS;
    if (unusable && n > 0) memset(unusable, 0, (size_t)n);
    if (n < 0 || (n > 0 && !args)) return fail_before_reduce(ERR_ARGS, buffer, length, reduce);
    if (n == 0) {
        if (length == 0) return OK;
        buffer[length - 1] = 0.0;
        return reduce(buffer, length) != 0 || buffer[length - 1] != 0.0 ? ERR_REDUCE : OK;
    }
    int64_t numel = 0, threads = 1;
    for (int64_t i = 0; i < n; i++) {
        int rc = check_args(&args[i]);
        if (rc == OK && args[i].global_rows > 0 &&
            (args[i].kind != KIND_FACTORED || args[i].global_rows < args[i].rows || args[i].reduce_offset < 0 ||
             args[i].reduce_offset + args[i].cols + 1 > length - 1))
            rc = ERR_ARGS;
        if (rc == OK && (i == 0 || args[i].lut != args[i - 1].lut)) rc = check_lut(args[i].lut); /* once per table */
        if (rc != OK) return fail_before_reduce(rc, buffer, length, reduce);
        numel += args[i].numel;
        if (args[i].threads > threads) threads = args[i].threads;
    }
    if (numel < PARALLEL_MIN_ELEMENTS) threads = 1;
    const int level = active_level();
    param_plan *plans = (param_plan *)calloc((size_t)n, sizeof(param_plan));
    if (!plans) return fail_before_reduce(ERR_NOMEM, buffer, length, reduce);
#if GEFEN_X86
    vbmi_tables *tables[8] = {0}; /* one per distinct codebook (an optimizer has one) */
    entry_table *entries[8] = {0};
    const gefen_step_args *owners[8] = {0};
    int n_tables = 0;
#endif
    int rc = OK;
    for (int64_t i = 0; i < n && rc == OK; i++) {
        const gefen_step_args *a = &args[i];
        param_plan *plan = &plans[i];
        plan->ctx = (block_ctx){a, 0, 0, 1, level, 0, 0, 0, 0};
#if GEFEN_X86
        if ((level == LEVEL_VBMI || level == LEVEL_AVX2) && rc == OK) {
            int found = -1, nomem = 0;
            for (int k = 0; k < n_tables; k++)
                if (owners[k]->codebook == a->codebook && owners[k]->thresholds == a->thresholds &&
                    owners[k]->lut == a->lut && owners[k]->steps == a->steps)
                    found = k;
            if (found < 0 && n_tables < 8) {
                if (level == LEVEL_VBMI) nomem = !(tables[n_tables] = make_vbmi_tables(a));
                else entries[n_tables] = make_entry_table(a, &nomem);
                owners[n_tables] = a;
                if (nomem) rc = ERR_NOMEM;
                found = n_tables++;
            }
            if (found < 0 && level == LEVEL_VBMI) plan->ctx.level = LEVEL_AVX512; /* > 8 codebooks: gathers */
            if (found >= 0) {
                plan->ctx.vt = tables[found];
                plan->ctx.et = entries[found]; /* 0: more than one compare needed, gathers */
            }
        }
#endif
        const int64_t P = a->period, B = a->numel / P;
        int64_t per_task = TASK_ELEMENTS / P;
        if (per_task < 1) per_task = 1;
        plan->ctx.blocks_per_task = per_task;
        plan->block_tasks = (B + per_task - 1) / per_task;
        if (a->kind == KIND_FACTORED && rc == OK) {
            const int64_t R = a->rows, C = a->cols;
            int64_t rows_per_task = (TASK_ELEMENTS + C - 1) / C;
            if ((R + rows_per_task - 1) / rows_per_task > 64) rows_per_task = (R + 63) / 64; /* partials <= 64 C */
            plan->stat_tasks = (R + rows_per_task - 1) / rows_per_task;
            plan->roots = (float *)malloc((size_t)(R + C) * sizeof(float));
            plan->sums = (double *)malloc((size_t)(R + C + plan->stat_tasks * C) * sizeof(double));
            if (!plan->roots || !plan->sums) rc = ERR_NOMEM;
            plan->sctx = (stats_ctx){a, plan->sums, plan->sums + R + C, rows_per_task, level};
            plan->ctx.row_root = plan->roots;
            plan->ctx.col_root = plan->roots + R;
        } else if (a->grad_bound > 0.0f && rc == OK) {
            plan->stat_tasks = (a->numel + TASK_ELEMENTS - 1) / TASK_ELEMENTS;
            plan->task_ok = (uint8_t *)malloc((size_t)plan->stat_tasks);
            if (!plan->task_ok) rc = ERR_NOMEM;
        }
    }
    int32_t *tp = 0;
    int64_t *tl = 0, *tc = 0;
    float *bufs = 0;
    if (rc == OK) { /* block buffers: one per thread, as long as the longest block */
        int64_t longest = 1;
        for (int64_t i = 0; i < n; i++)
            if (args[i].period > longest) longest = args[i].period;
        bufs = (float *)malloc((size_t)(threads * longest) * sizeof(float));
        if (!bufs) rc = ERR_NOMEM;
        for (int64_t i = 0; i < n; i++) {
            plans[i].ctx.bufs = bufs;
            plans[i].ctx.buf_stride = longest;
        }
    }
    if (rc == OK) {
        int64_t stat_total = count_tasks(plans, n, 1), block_total = count_tasks(plans, n, 0);
        int64_t most = stat_total > block_total ? stat_total : block_total;
        tp = (int32_t *)malloc((size_t)most * sizeof(int32_t));
        tl = (int64_t *)malloc((size_t)most * sizeof(int64_t));
        tc = (int64_t *)malloc((size_t)(most + 1) * sizeof(int64_t));
        if (!tp || !tl || !tc) rc = ERR_NOMEM;
    }
    if (rc == OK) { /* no write to a state or parameter before the reduce, nothing can fail after it */
        run_flat(plans, n, 1, threads, tp, tl, tc);
        for (int64_t i = 0; i < n; i++) { /* the usability check: after the statistics, before any write */
            const gefen_step_args *a = &args[i];
            if (!(a->grad_bound > 0.0f)) continue;
            int ok = 1;
            if (a->kind == KIND_FACTORED) ok = factored_usable(a, plans[i].sums, plans[i].ctx.level);
            else
                for (int64_t t = 0; t < plans[i].stat_tasks && ok; t++) ok = plans[i].task_ok[t];
            if (!ok) {
                rc = ERR_UNUSABLE;
                if (unusable) unusable[i] = 1;
            }
        }
    }
    if (rc == OK) {
        for (int64_t i = 0; i < n; i++) {
            if (args[i].kind != KIND_FACTORED) continue;
            plans[i].total = factored_sums(&args[i], &plans[i]);
            if (args[i].global_rows > 0) {
                double *piece = buffer + args[i].reduce_offset;
                memcpy(piece, plans[i].sums + args[i].rows, (size_t)args[i].cols * sizeof(double));
                piece[args[i].cols] = plans[i].total;
            }
        }
    }
    if (length > 0) { /* every rank, also one that failed above */
        buffer[length - 1] = rc == OK ? 0.0 : 1.0;
        if (reduce(buffer, length) != 0 || (rc == OK && buffer[length - 1] != 0.0)) rc = rc == OK ? ERR_REDUCE : rc;
    }
    if (rc == OK) {
        for (int64_t i = 0; i < n; i++) {
            const gefen_step_args *a = &args[i];
            if (a->kind != KIND_FACTORED) continue;
            if (a->global_rows > 0) {
                const double *piece = buffer + a->reduce_offset;
                memcpy(plans[i].sums + a->rows, piece, (size_t)a->cols * sizeof(double));
                factored_roots(a, &plans[i], piece[a->cols], a->global_rows);
            } else {
                factored_roots(a, &plans[i], plans[i].total, a->rows);
            }
        }
        run_flat(plans, n, 0, threads, tp, tl, tc);
        for (int64_t i = 0; i < n; i++)
            if (args[i].counter) *args[i].counter += 1;
    }
    free(tp);
    free(tl);
    free(tc);
    free(bufs);
    free_plans(plans, n);
#if GEFEN_X86
    for (int k = 0; k < n_tables; k++) {
        free(tables[k]);
        free_entry_table(entries[k]);
    }
#endif
    return rc;
}

int gefen_step_many(const gefen_step_args *args, int64_t n) {
    if (!args || n <= 0) return ERR_ARGS;
    for (int64_t i = 0; i < n; i++)
        if (args[i].global_rows > 0) return ERR_ARGS; /* sharded records need gefen_step_many_reduce */
    return gefen_step_many_reduce(args, n, 0, 0, 0, 0);
}

int gefen_step(const gefen_step_args *a) { return gefen_step_many(a, 1); }

/* ------------------------------------------------------------------ first step: the codebook fit */
#include "gefen_codebook.c"

/* ------------------------------------------------------------------ first step: the period search scores */
#include "gefen_period.c"
