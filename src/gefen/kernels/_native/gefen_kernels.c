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
 * Rounding rules (those of the eager torch reference, gefen.kernels.eager, documented there):
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
#define _POSIX_C_SOURCE 200809L /* sched_yield */
#include <float.h>
#include <math.h>
#include <stddef.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#define GEFEN_X86 1
#include <immintrin.h>
#else
#define GEFEN_X86 0
#endif

#define GEFEN_ABI_VERSION 7

#define INLINE __attribute__((always_inline)) inline
/* UNROLL4 fully unrolls the four 16-lane steps of a 64-element group, so their vectors stay in registers (GCC at -O2
 * keeps such loops rolled and the arrays they fill in memory); UNROLL2 takes two turns of a loop per iteration. */
#if defined(__clang__)
#define UNROLL4 _Pragma("clang loop unroll(full)")
#define UNROLL2 _Pragma("clang loop unroll_count(2)")
#elif defined(__GNUC__)
#define UNROLL4 _Pragma("GCC unroll 4")
#define UNROLL2 _Pragma("GCC unroll 2")
#else
#define UNROLL4
#define UNROLL2
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
/* Return codes; exported by name (gefen_error_code) so that Python never declares them a second time. */
enum {
    OK = 0,
    ERR_ARGS = -1,
    ERR_NOMEM = -2,
    ERR_REDUCE = -3,    /* another rank failed before the reduce */
    ERR_NONFINITE = -3, /* the period scores' gradient holds a NaN or an infinity */
    ERR_OVERFLOW = -4,  /* the period scores' g * g overflows fp32 */
    ERR_UNUSABLE = -5   /* a record's gradient failed its grad_bound check */
};

/* The argument record: its one declaration. Python builds its records from the layout that gefen_step_field exports
 * (names, offsets, sizes, types) and refuses to load a library whose fields differ from the ones it fills. */
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
#include "gefen_threads.c"

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
 * (b = bucket_of(u, buckets), a monotone function of u), chosen as the fewest
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

/* The scale of the vector passes' uniform buckets over [-1, 1]: the float just below nb / 2, so that u in [-1, 1]
 * falls in bucket trunc(fma(u, H, H)) in [0, nb - 1] with no clamp (u = 1 gives 2H < nb; u = -1 gives 0). */
static inline float bucket_half(int64_t nb) { return (float)(nb / 2) * (1.0f - 0x1p-24f); } /* nb: 2^k, k >= 1 */
/* The bucket of u among nb such buckets (clamped: the table builders' and the clamping passes' rule; NaN -> 0).
 * A monotone function of u, which is all the exact rule needs (see gefen.math.lookup). */
static inline int64_t bucket_of(float u, int64_t nb) {
    const float h = bucket_half(nb), t = fmaf(u, h, h);
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

/* ------------------------------------------------------------------ the x86 vector passes */
#include "gefen_step_x86.c"

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

/* ------------------------------------------------------------------ the record's layout and the return codes */
typedef struct {
    const char *name;
    int64_t offset, size;
    char type; /* 'p' pointer, 'q' int64, 'f' fp32 */
} field_info;

#define FIELD(name, type) {#name, (int64_t)offsetof(gefen_step_args, name), (int64_t)sizeof(((gefen_step_args *)0)->name), type}
static const field_info step_fields[] = {
    FIELD(param, 'p'),      FIELD(grad, 'p'),        FIELD(codes, 'p'),           FIELD(scale, 'p'),
    FIELD(v, 'p'),          FIELD(v_row, 'p'),       FIELD(v_col, 'p'),           FIELD(out, 'p'),
    FIELD(codebook, 'p'),   FIELD(lut, 'p'),         FIELD(thresholds, 'p'),      FIELD(numel, 'q'),
    FIELD(period, 'q'),     FIELD(rows, 'q'),        FIELD(cols, 'q'),            FIELD(param_dtype, 'q'),
    FIELD(grad_dtype, 'q'), FIELD(steps, 'q'),       FIELD(lerp_high, 'q'),       FIELD(kind, 'q'),
    FIELD(threads, 'q'),    FIELD(w, 'f'),           FIELD(beta2, 'f'),           FIELD(one_minus_beta2, 'f'),
    FIELD(eps, 'f'),        FIELD(decay, 'f'),       FIELD(step, 'f'),            FIELD(root_bc2, 'f'),
    FIELD(inv_bc1, 'f'),    FIELD(bc2, 'f'),         FIELD(grad_bound, 'f'),      FIELD(global_rows, 'q'),
    FIELD(reduce_offset, 'q'), FIELD(counter, 'p'),
};
#undef FIELD
/* every field is listed: the record has no padding, so the listed sizes add up to the whole record */
_Static_assert(sizeof(gefen_step_args) == 11 * sizeof(void *) + 10 * 8 + 10 * 4 + 2 * 8 + sizeof(void *),
               "a field of gefen_step_args is missing from step_fields");

/* The size of one gefen_step_args record in bytes. */
int64_t gefen_step_record_size(void) { return (int64_t)sizeof(gefen_step_args); }

/* Field i of the record (0 <= i < the count returned for i = -1): its name, byte offset, size and type. Returns the
 * number of fields for i = -1, 0 for a valid i, ERR_ARGS past the end. */
int64_t gefen_step_field(int64_t i, const char **name, int64_t *offset, int64_t *size, char *type) {
    int64_t count = (int64_t)(sizeof(step_fields) / sizeof(step_fields[0]));
    if (i < 0) return count;
    if (i >= count || !name || !offset || !size || !type) return ERR_ARGS;
    *name = step_fields[i].name;
    *offset = step_fields[i].offset;
    *size = step_fields[i].size;
    *type = step_fields[i].type;
    return 0;
}

/* Return code i by name (the enum above); returns ERR_ARGS past the end, 0 otherwise. */
int gefen_error_code(int64_t i, const char **name, int *value) {
    static const struct {
        const char *name;
        int value;
    } codes[] = {{"OK", OK},         {"ERR_ARGS", ERR_ARGS},         {"ERR_NOMEM", ERR_NOMEM},
                 {"ERR_REDUCE", ERR_REDUCE}, {"ERR_NONFINITE", ERR_NONFINITE}, {"ERR_OVERFLOW", ERR_OVERFLOW},
                 {"ERR_UNUSABLE", ERR_UNUSABLE}};
    if (i < 0 || i >= (int64_t)(sizeof(codes) / sizeof(codes[0])) || !name || !value) return ERR_ARGS;
    *name = codes[i].name;
    *value = codes[i].value;
    return 0;
}

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

/* ------------------------------------------------------------------ statistics pass and usability check */
#include "gefen_stats.c"

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
    double total;  /* factored: fp64 sum of the updated row moments (this rank's, then all ranks') */
    int64_t rows_all; /* factored: rows over all ranks (global_rows when row-sharded, else R) */
    uint8_t unusable; /* grad_bound > 0: the usability check failed */
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

/* The tasks of every parameter (stats or block phase) as one loop of a parallel region. tp, tl and cost hold room
 * for count_tasks(plans, n, stats) entries (cost one more); f is the loop's context. */
static loop_phase flat_phase(param_plan *plans, int64_t n, int stats, flat_ctx *f, int32_t *tp, int64_t *tl,
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
    *f = (flat_ctx){plans, tp, tl};
    return (loop_phase){stats ? flat_stats_task : flat_block_task, f, k, cost, 0, 0};
}

/* Between the statistics and the block loop, one task per parameter (its own plan only, so the parameters share
 * the threads; the summation orders are the per-parameter ones, whatever the thread count). Before the reduce
 * (finish_task): the usability check of a record with grad_bound > 0 and a factored record's column sums and
 * updated row moments, nothing written outside the plans; after it (roots_task): a factored record's v_row, v_col
 * and step-size roots. One thread doing these for every parameter took 1.3 ms of a 15 ms step (Zen 4, the
 * benchmark's 23.5M parameters), the other thread idle. */
static void finish_task(const void *ctx_, int64_t i, int64_t thread) {
    (void)thread;
    param_plan *plan = &((param_plan *)ctx_)[i];
    const gefen_step_args *a = plan->ctx.a;
    if (a->grad_bound > 0.0f) {
        int ok = 1;
        if (a->kind == KIND_FACTORED) ok = factored_usable(a, plan->sums, plan->ctx.level);
        else
            for (int64_t t = 0; t < plan->stat_tasks && ok; t++) ok = plan->task_ok[t];
        plan->unusable = (uint8_t)!ok;
    }
    if (a->kind == KIND_FACTORED) plan->total = factored_sums(a, plan->sums, plan->stat_tasks, plan->roots);
}
static void roots_task(const void *ctx_, int64_t i, int64_t thread) {
    (void)thread;
    param_plan *plan = &((param_plan *)ctx_)[i];
    const gefen_step_args *a = plan->ctx.a;
    if (a->kind == KIND_FACTORED) factored_roots(a, plan->sums, plan->roots, plan->total, plan->rows_all);
}
/* The cumulative costs (n + 1) of finish_task (roots: 0) or roots_task (roots: 1) over the parameters. */
static const int64_t *plan_costs(const param_plan *plans, int64_t n, int roots, int64_t *cost) {
    cost[0] = 0;
    for (int64_t i = 0; i < n; i++) {
        const gefen_step_args *a = plans[i].ctx.a;
        int64_t c = 1;
        if (a->kind == KIND_FACTORED) c += a->rows + a->cols + (roots ? 0 : plans[i].stat_tasks * a->cols);
        else if (!roots) c += plans[i].stat_tasks;
        cost[i + 1] = cost[i] + c;
    }
    return cost;
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

/* One step of n parameters (records args[0..n)), all of whose tasks share two parallel regions (the statistics
 * and finish_task's loops, then roots_task's and the block loop, with the checks and the reduce between them, on
 * the calling thread). Every record is checked and every buffer allocated before the first write: an error return
 * has changed nothing.
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
            plan->rows_all = a->global_rows > 0 ? a->global_rows : R;
            plan->ctx.row_root = plan->roots;
            plan->ctx.col_root = plan->roots + R;
        } else if (a->grad_bound > 0.0f && rc == OK) {
            plan->stat_tasks = (a->numel + TASK_ELEMENTS - 1) / TASK_ELEMENTS;
            plan->task_ok = (uint8_t *)malloc((size_t)plan->stat_tasks);
            if (!plan->task_ok) rc = ERR_NOMEM;
        }
    }
    int32_t *tp = 0;
    int64_t *tl = 0, *tc = 0, *pc = 0;
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
    const int64_t stat_total = rc == OK ? count_tasks(plans, n, 1) : 0; /* 0: nothing to check or sum */
    if (rc == OK) {
        int64_t block_total = count_tasks(plans, n, 0);
        int64_t most = stat_total > block_total ? stat_total : block_total;
        tp = (int32_t *)malloc((size_t)most * sizeof(int32_t));
        tl = (int64_t *)malloc((size_t)most * sizeof(int64_t));
        tc = (int64_t *)malloc((size_t)(most + 1) * sizeof(int64_t));
        pc = (int64_t *)malloc((size_t)(n + 1) * sizeof(int64_t));
        if (!tp || !tl || !tc || !pc) rc = ERR_NOMEM;
    }
    flat_ctx flat;
    /* no write to a state or parameter before the reduce, and nothing can fail after it */
    if (rc == OK && stat_total > 0) {
        loop_phase phases[2] = {flat_phase(plans, n, 1, &flat, tp, tl, tc),
                                {finish_task, plans, n, plan_costs(plans, n, 0, pc), 0, 0}};
        parallel_phases(phases, 2, threads);
        for (int64_t i = 0; i < n; i++) /* the usability check: after the statistics, before any write */
            if (plans[i].unusable) {
                rc = ERR_UNUSABLE;
                if (unusable) unusable[i] = 1;
            }
    }
    if (rc == OK)
        for (int64_t i = 0; i < n; i++) {
            const gefen_step_args *a = &args[i];
            if (a->kind != KIND_FACTORED || a->global_rows <= 0) continue;
            double *piece = buffer + a->reduce_offset;
            memcpy(piece, plans[i].sums + a->rows, (size_t)a->cols * sizeof(double));
            piece[a->cols] = plans[i].total;
        }
    if (length > 0) { /* every rank, also one that failed above */
        buffer[length - 1] = rc == OK ? 0.0 : 1.0;
        if (reduce(buffer, length) != 0 || (rc == OK && buffer[length - 1] != 0.0)) rc = rc == OK ? ERR_REDUCE : rc;
    }
    if (rc == OK) {
        for (int64_t i = 0; i < n; i++) {
            const gefen_step_args *a = &args[i];
            if (a->kind != KIND_FACTORED || a->global_rows <= 0) continue;
            const double *piece = buffer + a->reduce_offset; /* the sums over every rank's rows */
            memcpy(plans[i].sums + a->rows, piece, (size_t)a->cols * sizeof(double));
            plans[i].total = piece[a->cols];
        }
        loop_phase phases[2] = {{roots_task, plans, n, plan_costs(plans, n, 1, pc), 0, 0},
                                flat_phase(plans, n, 0, &flat, tp, tl, tc)};
        parallel_phases(phases, 2, threads);
        for (int64_t i = 0; i < n; i++)
            if (args[i].counter) *args[i].counter += 1;
    }
    free(tp);
    free(tl);
    free(tc);
    free(pc);
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


/* ------------------------------------------------------------------ first step: the codebook fit */
#include "gefen_codebook.c"

/* ------------------------------------------------------------------ first step: the period search scores */
#include "gefen_period.c"
