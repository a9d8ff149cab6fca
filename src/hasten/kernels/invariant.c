/* Row-invariant kernels for hasten's CPU forwards: a linear layer, attention, and the RMS norm and rotary
 * embedding around them (at the end of this file).
 *
 * Every output element is computed by one fixed sequence of IEEE-754 operations that depends
 * only on that element's own inputs: never on how many rows a call carries, which other rows
 * ride along, how many threads run, or which instruction set does the work. A verification
 * block of k positions therefore gives each position exactly the numbers a one-token step
 * gives, and because each operation used (fused multiply-add, addition, multiplication,
 * division, rounding to an integer, conversions between float formats) is correctly rounded,
 * the AVX-512, AVX2 and portable paths below produce the same bits on any CPU.
 *
 * The definitions (the contract every path implements):
 *   linear:    acc = 0; for k in 0..K-1: acc = fma(x[k], w[n][k], acc);  y = round(acc + bias[n])
 *   attention: per query row and head, over the row's visible keys j_0 < j_1 < ... in list order
 *              s_i  = dot(q, k_{j_i}) * scale  (dot: 16 lanes by d mod 16 accumulated by fma in d
 *                     order, then summed pairwise: lane l += lane l + 8, l + 4, l + 2, l + 1)
 *              s_i  = softcap * tanh(s_i / softcap)   when softcap > 0
 *              p_i  = exp(s_i - max s)                (hexp below: a fixed polynomial)
 *              l    = sum of p_i: 16 lanes by i mod 16 in i order, then summed pairwise as above
 *              o[d] = round((sum over i in order of fma(p_i, v_{j_i}[d], .)) / l)
 * Values are read as float32 (bf16 and fp16 convert exactly) and results are rounded to the
 * output format to nearest even. bfloat16 layers may instead take the CPU's bfloat16 dot product
 * (AVX512-BF16) or AMX's tiles, each with a contract of its own (below, "linear"): other bits than
 * these, the same independence of the other rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HASTEN_X86 1
#endif

enum { BF16 = 0, FP16 = 1, FP32 = 2 };
#define TILE 64 /* output features per packed weight tile: [tiles][K][TILE] */
#define LANES 16

/* ---- scalar conversions (exact to float32; rounding to nearest even from it) ---------------- */
static inline float bf16_to_f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float fp16_to_f32(uint16_t h) { _Float16 v; memcpy(&v, &h, 2); return (float)v; }
static inline uint16_t f32_to_fp16(float f) { _Float16 v = (_Float16)f; uint16_t h; memcpy(&h, &v, 2); return h; }

static inline float load1(const void *p, int64_t i, int dtype) {
    if (dtype == BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
    if (dtype == FP16) return fp16_to_f32(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}
static inline void store1(void *p, int64_t i, float f, int dtype) {
    if (dtype == BF16) ((uint16_t *)p)[i] = f32_to_bf16(f);
    else if (dtype == FP16) ((uint16_t *)p)[i] = f32_to_fp16(f);
    else ((float *)p)[i] = f;
}

/* n values from p + offset to float32, the format switch outside the loop so each loop vectorizes */
static inline void load_row(const void *p, int64_t offset, int64_t n, int dtype, float *dst) {
    if (dtype == BF16) {
        const uint16_t *src = (const uint16_t *)p + offset;
        for (int64_t i = 0; i < n; i++) { uint32_t u = (uint32_t)src[i] << 16; memcpy(dst + i, &u, 4); }
    } else if (dtype == FP16) {
        const _Float16 *src = (const _Float16 *)p + offset;
        for (int64_t i = 0; i < n; i++) dst[i] = (float)src[i];
    } else {
        memcpy(dst, (const float *)p + offset, sizeof(float) * (size_t)n);
    }
}

static int threads_for(int requested, int64_t work_items) {
    int t = requested < 1 ? 1 : requested;
    if (work_items < t) t = (int)(work_items < 1 ? 1 : work_items);
    return t;
}

/* ======================================= linear ============================================= */
/* x: [M, K] (row stride sx), w: packed [ceil(N / TILE)][K][TILE], bias: [N] or NULL, y: [M, N]
 * (row stride sy). x, w, y and bias each have their own format. */

/* The portable path: the contract written out. */
static void linear_tile_generic(const void *x, int64_t sx, int xt, const void *w, int wt, const void *bias, int bt,
                                void *y, int64_t sy, int yt, int64_t rows, int64_t K, int64_t N, int64_t tile) {
    const int64_t base = tile * K * TILE, n0 = tile * TILE;
    const int64_t width = N - n0 < TILE ? N - n0 : TILE;
    for (int64_t m = 0; m < rows; m++) {
        float acc[TILE];
        for (int l = 0; l < TILE; l++) acc[l] = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            const float xv = load1(x, m * sx + k, xt);
            for (int l = 0; l < TILE; l++) acc[l] = fmaf(xv, load1(w, base + k * TILE + l, wt), acc[l]);
        }
        for (int64_t l = 0; l < width; l++) {
            float v = acc[l];
            if (bias) v = v + load1(bias, n0 + l, bt);
            store1(y, m * sy + n0 + l, v, yt);
        }
    }
}

#ifdef HASTEN_X86
#define R_MAX 6 /* rows per register block: 6 rows x 4 vectors = 24 accumulators */

__attribute__((target("avx512f"))) static inline __m512 load16_avx512(const void *p, int dtype) {
    if (dtype == BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    if (dtype == FP16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_loadu_ps(p);
}

/* rows <= R_MAX rows of x against one tile; R is a compile-time constant in each instance */
#define DEFINE_AVX512_BLOCK(R)                                                                                  \
    __attribute__((target("avx512f"))) static void linear_block_avx512_##R(                                 \
        const float *xf, int64_t K, const void *wtile, int wt, float *out /* [R][TILE] */) {                 \
        __m512 acc[R][4];                                                                                    \
        for (int r = 0; r < R; r++) for (int v = 0; v < 4; v++) acc[r][v] = _mm512_setzero_ps();             \
        const size_t esize = wt == FP32 ? 4 : 2;                                                             \
        const char *wp = (const char *)wtile;                                                                \
        for (int64_t k = 0; k < K; k++) {                                                                    \
            const char *row = wp + (size_t)k * TILE * esize;                                                 \
            __m512 w0 = load16_avx512(row, wt), w1 = load16_avx512(row + 16 * esize, wt);                    \
            __m512 w2 = load16_avx512(row + 32 * esize, wt), w3 = load16_avx512(row + 48 * esize, wt);       \
            for (int r = 0; r < R; r++) {                                                                    \
                __m512 xv = _mm512_set1_ps(xf[r * K + k]);                                                   \
                acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);                                              \
                acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);                                              \
                acc[r][2] = _mm512_fmadd_ps(xv, w2, acc[r][2]);                                              \
                acc[r][3] = _mm512_fmadd_ps(xv, w3, acc[r][3]);                                              \
            }                                                                                                \
        }                                                                                                    \
        for (int r = 0; r < R; r++) for (int v = 0; v < 4; v++) _mm512_storeu_ps(out + r * TILE + 16 * v, acc[r][v]); \
    }
DEFINE_AVX512_BLOCK(1)
DEFINE_AVX512_BLOCK(2)
DEFINE_AVX512_BLOCK(3)
DEFINE_AVX512_BLOCK(4)
DEFINE_AVX512_BLOCK(5)
DEFINE_AVX512_BLOCK(6)

typedef void (*block_fn)(const float *, int64_t, const void *, int, float *);
static const block_fn AVX512_BLOCKS[R_MAX + 1] = {0, linear_block_avx512_1, linear_block_avx512_2, linear_block_avx512_3,
                                                  linear_block_avx512_4, linear_block_avx512_5, linear_block_avx512_6};

/* AVX2 + FMA: 8 lanes; a tile is 8 vectors, rows one or two at a time */
__attribute__((target("avx2,fma,f16c"))) static inline __m256 load8_avx2(const void *p, int dtype) {
    if (dtype == BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    if (dtype == FP16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    return _mm256_loadu_ps(p);
}
__attribute__((target("avx2,fma,f16c"))) static void linear_block_avx2(const float *xf, int64_t K, const void *wtile,
                                                                       int wt, float *out, int rows) {
    const size_t esize = wt == FP32 ? 4 : 2;
    const char *wp = (const char *)wtile;
    for (int r0 = 0; r0 < rows; r0 += 1) {
        __m256 acc[8];
        for (int v = 0; v < 8; v++) acc[v] = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k++) {
            const char *row = wp + (size_t)k * TILE * esize;
            __m256 xv = _mm256_set1_ps(xf[r0 * K + k]);
            for (int v = 0; v < 8; v++) acc[v] = _mm256_fmadd_ps(xv, load8_avx2(row + 8 * v * esize, wt), acc[v]);
        }
        for (int v = 0; v < 8; v++) _mm256_storeu_ps(out + r0 * TILE + 8 * v, acc[v]);
    }
}
#endif

static int forced_path = -1;
static int cpu_path(void) { /* 2: AVX-512F, 1: AVX2 + FMA + F16C, 0: portable */
#ifdef HASTEN_X86
    static int path = -1;
    if (forced_path >= 0) return forced_path;
    if (path < 0) {
        __builtin_cpu_init();
        if (getenv("HASTEN_KERNEL_PATH")) path = atoi(getenv("HASTEN_KERNEL_PATH"));
        else if (__builtin_cpu_supports("avx512f")) path = 2;
        else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) path = 1;
        else path = 0;
    }
    return path;
#else
    return 0;
#endif
}

int hasten_kernel_path(void) { return cpu_path(); }

/* for tests: run another path (0 portable, 1 AVX2, 2 AVX-512) where the CPU has it; -1 back to the CPU's best */
int hasten_set_kernel_path(int path) {
#ifdef HASTEN_X86
    cpu_path();
    __builtin_cpu_init();
    const int best = __builtin_cpu_supports("avx512f") ? 2 : (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) ? 1 : 0;
    if (path > best) return -1;
    forced_path = path < 0 ? best : path;
    return 0;
#else
    return path > 0 ? -1 : 0;
#endif
}

void hasten_linear(const void *x, int64_t sx, int xt, const void *w, int wt, const void *bias, int bt, void *y,
                   int64_t sy, int yt, int64_t M, int64_t K, int64_t N, int threads) {
    const int64_t tiles = (N + TILE - 1) / TILE;
    const int path = cpu_path();
    if (path == 0) {
#pragma omp parallel for schedule(static) num_threads(threads_for(threads, tiles))
        for (int64_t t = 0; t < tiles; t++) linear_tile_generic(x, sx, xt, w, wt, bias, bt, y, sy, yt, M, K, N, t);
        return;
    }
#ifdef HASTEN_X86
    /* x converted once to float32 (exact), so the blocks broadcast plain floats */
    float *xf = (float *)malloc(sizeof(float) * (size_t)(M * K > 0 ? M * K : 1));
    for (int64_t m = 0; m < M; m++) for (int64_t k = 0; k < K; k++) xf[m * K + k] = load1(x, m * sx + k, xt);
    const size_t esize = wt == FP32 ? 4 : 2;
#pragma omp parallel num_threads(threads_for(threads, tiles))
    {
        float out[R_MAX * TILE];
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const void *wtile = (const char *)w + (size_t)(t * K * TILE) * esize;
            const int64_t n0 = t * TILE, width = N - n0 < TILE ? N - n0 : TILE;
            for (int64_t m0 = 0; m0 < M; m0 += R_MAX) {
                const int rows = (int)(M - m0 < R_MAX ? M - m0 : R_MAX);
                if (path == 2) AVX512_BLOCKS[rows](xf + m0 * K, K, wtile, wt, out);
                else linear_block_avx2(xf + m0 * K, K, wtile, wt, out, rows);
                for (int r = 0; r < rows; r++)
                    for (int64_t l = 0; l < width; l++) {
                        float v = out[r * TILE + l];
                        if (bias) v = v + load1(bias, n0 + l, bt);
                        store1(y, (m0 + r) * sy + n0 + l, v, yt);
                    }
            }
        }
    }
    free(xf);
#endif
}

/* ---- bfloat16 weights and inputs on CPUs with AVX512-BF16: the dot-product instruction -------
 * A second contract, for speed where the instruction exists: acc = 0; for each pair of inputs
 * (2i, 2i + 1) in order: acc = vdpbf16ps(acc, x pair, w pair); y = round(acc + bias[n]). The
 * instruction's rounding is the CPU's, so its bits differ from the contract above and from CPUs
 * without it; like it, each output depends on its own row alone, whatever the rows, threads or
 * blocking. Weights packed as [tiles][pairs][TILE][2], pairs >= ceil(K / 2) (zeros past K). */
int hasten_bf16_dot_available(void) {
#ifdef HASTEN_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512f");
#else
    return 0;
#endif
}

/* w [N][K] -> out [ceil(N / TILE)][pairs][TILE][2]; pairs past ceil(K / 2) (the AMX layout's
 * padding to whole tiles) and outputs past N are zeros */
void hasten_pack_bf16_pairs(const uint16_t *w, int64_t N, int64_t K, int64_t pairs, uint16_t *out) {
    const int64_t tiles = (N + TILE - 1) / TILE;
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t p = 0; p < pairs; p++)
            for (int64_t l = 0; l < TILE; l++)
                for (int64_t e = 0; e < 2; e++) {
                    const int64_t n = t * TILE + l, k = 2 * p + e;
                    out[((t * pairs + p) * TILE + l) * 2 + e] = (n < N && k < K) ? w[n * K + k] : 0;
                }
}

#ifdef HASTEN_X86
/* f32_to_bf16 on 16 lanes: the same integer rounding (nearest even, NaN kept a quiet NaN), so the
 * same bits */
__attribute__((target("avx512f"))) static inline __m256i bf16_round16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
}

/* a block's float32 sums (out [rows][TILE]) plus bias, rounded to bfloat16 into y's rows m0.. and
 * columns n0..n0 + width, 16 at a time (one at a time this took about 30 % of the LM head's time
 * at 64 rows on AMX: a batch's results outnumber its weights there) */
__attribute__((target("avx512f"))) static void store_block_bf16(const float *out, int rows, int64_t width,
                                                                 const void *bias, int bt, uint16_t *y, int64_t sy,
                                                                 int64_t m0, int64_t n0) {
    const size_t bsize = bt == FP32 ? 4 : 2;
    for (int r = 0; r < rows; r++) {
        uint16_t *dst = y + (m0 + r) * sy + n0;
        int64_t l = 0;
        for (; l + 16 <= width; l += 16) {
            __m512 v = _mm512_loadu_ps(out + r * TILE + l);
            if (bias) v = _mm512_add_ps(v, load16_avx512((const char *)bias + (size_t)(n0 + l) * bsize, bt));
            _mm256_storeu_si256((__m256i *)(dst + l), bf16_round16(v));
        }
        for (; l < width; l++) {
            float v = out[r * TILE + l];
            if (bias) v = v + load1(bias, n0 + l, bt);
            dst[l] = f32_to_bf16(v);
        }
    }
}

#define DEFINE_DOT_BLOCK(R)                                                                                     \
    __attribute__((target("avx512f,avx512bf16"))) static void dot_block_##R(                                 \
        const uint32_t *xp, int64_t pairs, const uint16_t *wtile, float *out /* [R][TILE] */) {              \
        __m512 acc[R][4];                                                                                    \
        for (int r = 0; r < R; r++) for (int v = 0; v < 4; v++) acc[r][v] = _mm512_setzero_ps();             \
        for (int64_t p = 0; p < pairs; p++) {                                                                \
            const __m512i *row = (const __m512i *)(wtile + p * TILE * 2);                                    \
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(row), w1 = (__m512bh)_mm512_loadu_si512(row + 1); \
            const __m512bh w2 = (__m512bh)_mm512_loadu_si512(row + 2), w3 = (__m512bh)_mm512_loadu_si512(row + 3); \
            for (int r = 0; r < R; r++) {                                                                    \
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[r * pairs + p]);                     \
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);                                             \
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);                                             \
                acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xv, w2);                                             \
                acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xv, w3);                                             \
            }                                                                                                \
        }                                                                                                    \
        for (int r = 0; r < R; r++) for (int v = 0; v < 4; v++) _mm512_storeu_ps(out + r * TILE + 16 * v, acc[r][v]); \
    }
#define DOT_R_MAX 7
DEFINE_DOT_BLOCK(1)
DEFINE_DOT_BLOCK(2)
DEFINE_DOT_BLOCK(3)
DEFINE_DOT_BLOCK(4)
DEFINE_DOT_BLOCK(5)
DEFINE_DOT_BLOCK(6)
DEFINE_DOT_BLOCK(7)
typedef void (*dot_fn)(const uint32_t *, int64_t, const uint16_t *, float *);
static const dot_fn DOT_BLOCKS[DOT_R_MAX + 1] = {0, dot_block_1, dot_block_2, dot_block_3, dot_block_4, dot_block_5,
                                                 dot_block_6, dot_block_7};

/* the rows of x as pairs, `pairs` a row, zeros past K: calloc'd [rows_padded][pairs] */
static uint32_t *rows_as_pairs(const uint16_t *x, int64_t sx, int64_t M, int64_t rows_padded, int64_t K,
                               int64_t pairs) {
    uint32_t *xp = (uint32_t *)calloc((size_t)(rows_padded * pairs > 0 ? rows_padded * pairs : 1), sizeof(uint32_t));
    if (xp) for (int64_t m = 0; m < M; m++) memcpy(xp + m * pairs, x + m * sx, sizeof(uint16_t) * (size_t)K);
    return xp;
}

static int linear_bf16_dot(const uint16_t *x, int64_t sx, const uint16_t *w, int64_t pairs, const void *bias, int bt,
                           uint16_t *y, int64_t sy, int64_t M, int64_t K, int64_t N, int threads) {
    if (!hasten_bf16_dot_available()) return -1;
    const int64_t tiles = (N + TILE - 1) / TILE;
    uint32_t *xp = rows_as_pairs(x, sx, M, M, K, pairs);
    if (!xp) return -2;
#pragma omp parallel num_threads(threads_for(threads, tiles))
    {
        float out[DOT_R_MAX * TILE];
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n0 = t * TILE, width = N - n0 < TILE ? N - n0 : TILE;
            for (int64_t m0 = 0; m0 < M; m0 += DOT_R_MAX) {
                const int rows = (int)(M - m0 < DOT_R_MAX ? M - m0 : DOT_R_MAX);
                DOT_BLOCKS[rows](xp + m0 * pairs, pairs, w + t * pairs * TILE * 2, out);
                store_block_bf16(out, rows, width, bias, bt, y, sy, m0, n0);
            }
        }
    }
    free(xp);
    return 0;
}
#endif

/* ---- bfloat16 on CPUs with AMX: TDPBF16PS tiles -----------------------------------------------
 * A third contract, AMX's: acc = 0; for each chunk of 16 input pairs (32 inputs) in order:
 * acc = tdpbf16ps(acc, x chunk, w chunk); y = round(acc + bias[n]). Row invariant by
 * construction: TDPBF16PS computes each element C[m][n] of its 16 x 16 result from C[m][n], row m
 * of A (one input row's chunk) and column n of B (one output feature's chunk) alone, in an order
 * the instruction fixes; the tile shapes never change (A, B and C always 16 rows of 64 bytes, rows
 * past M zeros), and the chunks go in K order whatever the rows, threads or blocking. So a row gets
 * the same bits as a tile's only row or as one of 16, at any position, in any call. The rounding
 * is AMX's (the pair's products summed as the unit sums them, denormals flushed), so the bits
 * differ from the dot product's: where AMX is on, every bfloat16 layer of the process runs it, one
 * row (plain decoding) or many (a batch, a verification block). Weights: the pair layout with the
 * pairs padded to whole chunks (zeros), so a B tile is 16 pairs x 16 outputs of a 64-output tile,
 * its rows 256 bytes apart. */
#if defined(HASTEN_X86) && defined(__x86_64__) && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define HASTEN_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_ROWS 16  /* rows of every tile */
#define AMX_PAIRS 16 /* input pairs per chunk: an A tile's 64-byte row, a B tile's 16 rows */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;

/* every tile 16 rows x 64 bytes: tile 0 A (16 rows x 16 pairs), 1-3 B (16 pairs x 16 outputs),
 * 4-7 C (16 rows x 16 float32 outputs). A constant in memory: GCC 12 drops stores to a stack copy
 * that only ldtilecfg reads (seen: tiles 8-15's bytes left as garbage, a #GP) */
static const tile_config AMX_CONFIG __attribute__((aligned(64))) = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {AMX_ROWS, AMX_ROWS, AMX_ROWS, AMX_ROWS, AMX_ROWS, AMX_ROWS, AMX_ROWS, AMX_ROWS}};

/* per thread, since the tile state is */
__attribute__((target("amx-tile"))) static void amx_configure(void) { _tile_loadconfig(&AMX_CONFIG); }
__attribute__((target("amx-tile"))) static void amx_release(void) { _tile_release(); }

/* 16 rows (xa [16][pairs] pairs) against one 64-output tile (wtile [pairs][TILE][2]): C tiles 4-7
 * accumulate outputs 0-15, 16-31, 32-47, 48-63 over the chunks in order -> out [16][TILE] */
__attribute__((target("amx-tile,amx-bf16"))) static void amx_block(const uint32_t *xa, int64_t pairs,
                                                                   const uint16_t *wtile, float *out) {
    const int64_t a_stride = pairs * 4, b_stride = TILE * 4; /* bytes between tile rows */
    __asm__ __volatile__("" ::: "memory"); /* the tile loads and stores are asm: memory is theirs to read and write */
    _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
    for (int64_t p = 0; p < pairs; p += AMX_PAIRS) {
        const uint16_t *b = wtile + p * TILE * 2;
        _tile_loadd(0, xa + p, a_stride);
        _tile_loadd(1, b, b_stride);      _tile_dpbf16ps(4, 0, 1);
        _tile_loadd(2, b + 32, b_stride); _tile_dpbf16ps(5, 0, 2);
        _tile_loadd(3, b + 64, b_stride); _tile_dpbf16ps(6, 0, 3);
        _tile_loadd(1, b + 96, b_stride); _tile_dpbf16ps(7, 0, 1);
    }
    _tile_stored(4, out, b_stride); _tile_stored(5, out + 16, b_stride);
    _tile_stored(6, out + 32, b_stride); _tile_stored(7, out + 48, b_stride);
    __asm__ __volatile__("" ::: "memory");
}

static int linear_bf16_amx(const uint16_t *x, int64_t sx, const uint16_t *w, int64_t pairs, const void *bias, int bt,
                           uint16_t *y, int64_t sy, int64_t M, int64_t K, int64_t N, int threads) {
    if (pairs % AMX_PAIRS) return -1; /* not the AMX layout */
    const int64_t tiles = (N + TILE - 1) / TILE, blocks = (M + AMX_ROWS - 1) / AMX_ROWS;
    uint32_t *xa = rows_as_pairs(x, sx, M, blocks * AMX_ROWS, K, pairs); /* whole A tiles, zero rows past M */
    if (!xa) return -2;
#pragma omp parallel num_threads(threads_for(threads, tiles))
    {
        float out[AMX_ROWS * TILE];
        amx_configure();
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n0 = t * TILE, width = N - n0 < TILE ? N - n0 : TILE;
            for (int64_t m0 = 0; m0 < M; m0 += AMX_ROWS) { /* rows past 16: the next A tile, the same weights */
                amx_block(xa + m0 * pairs, pairs, w + t * pairs * TILE * 2, out);
                store_block_bf16(out, (int)(M - m0 < AMX_ROWS ? M - m0 : AMX_ROWS), width, bias, bt, y, sy, m0, n0);
            }
        }
        amx_release();
    }
    free(xa);
    return 0;
}
#endif

/* whether this CPU and kernel run AMX's bfloat16 tiles here: the CPU has AMX-TILE and AMX-BF16
 * (cpuid) and Linux granted this process the tile state (asked once) */
int hasten_amx_available(void) {
#ifdef HASTEN_AMX
    static int available = -1;
    if (available < 0) {
        unsigned a, b, c, d;
        const int cpu = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1) && (d >> 24 & 1);
        available = cpu && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return available;
#else
    return 0;
#endif
}

/* x [M][K] (row stride sx) against w packed by hasten_pack_bf16_pairs with `pairs` pairs: AMX's
 * tiles where `amx` (pairs a multiple of 16), else the dot product. -1: the CPU lacks it. */
int hasten_linear_bf16_pairs(const uint16_t *x, int64_t sx, const uint16_t *w, int64_t pairs, int amx,
                             const void *bias, int bt, uint16_t *y, int64_t sy, int64_t M, int64_t K, int64_t N,
                             int threads) {
#ifdef HASTEN_AMX
    if (amx) return hasten_amx_available() ? linear_bf16_amx(x, sx, w, pairs, bias, bt, y, sy, M, K, N, threads) : -1;
#endif
#ifdef HASTEN_X86
    if (!amx) return linear_bf16_dot(x, sx, w, pairs, bias, bt, y, sy, M, K, N, threads);
#endif
    return -1;
}

/* ====================================== attention =========================================== */
/* The work is scheduled for speed (keys KB at a time, shared by every query head of a group and
 * by every row that sees them; values shared by the heads of a group), but each number is the
 * contract's: a score is one key's sequential dot product, the exponential sum goes by lanes of
 * list position mod 16, and each output feature accumulates its row's keys in list order. KB is
 * scheduling alone (no number depends on it): 32 keys give a row's three query heads six
 * independent dot-product chains, enough to hide the FMA latency that 16 keys (three chains) left
 * exposed. */
#define KB 32

static inline float lanes_sum(float *lanes) { /* pairwise, fixed: 16 -> 8 -> 4 -> 2 -> 1 */
    for (int width = LANES / 2; width >= 1; width /= 2)
        for (int l = 0; l < width; l++) lanes[l] = lanes[l] + lanes[l + width];
    return lanes[0];
}

/* exp(x) for x <= 0 (what softmax needs), from +, *, fma, rint and exponent bits only, so every
 * path gives the same bits: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-7 polynomial. */
static inline float hexp(float x) {
    if (x < -87.0f) return 0.0f;
    const float n = rintf(x * 1.44269504088896341f);
    float r = fmaf(n, -0.693145751953125f, x);
    r = fmaf(n, -1.428606765330187045e-06f, r);
    float p = 1.98412698412698413e-4f;
    p = fmaf(p, r, 1.38888888888888889e-3f);
    p = fmaf(p, r, 8.33333333333333333e-3f);
    p = fmaf(p, r, 4.16666666666666667e-2f);
    p = fmaf(p, r, 1.66666666666666667e-1f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    int32_t e = (int32_t)n + 127; /* n >= -126 here: a normal scale */
    uint32_t bits = (uint32_t)e << 23; float scale; memcpy(&scale, &bits, 4);
    return p * scale;
}

static inline float htanh(float x) { /* odd, from hexp */
    const float a = fabsf(x);
    const float e = hexp(-2.0f * a);
    const float t = (1.0f - e) / (1.0f + e);
    return x < 0 ? -t : t;
}

/* ---- the hot loops, each in AVX-512, AVX2 and portable C (the same operations) ------------- */
/* scores of queries qf [nq][D] against keys kt [D][KB] (transposed): out [nq][KB], each a
 * sequential fma over d */
static void score_block_generic(const float *qf, int nq, int64_t D, const float *kt, float *out) {
    for (int a = 0; a < nq; a++) {
        float s[KB];
        for (int l = 0; l < KB; l++) s[l] = 0.0f;
        for (int64_t d = 0; d < D; d++) for (int l = 0; l < KB; l++) s[l] = fmaf(qf[a * D + d], kt[d * KB + l], s[l]);
        for (int l = 0; l < KB; l++) out[a * KB + l] = s[l];
    }
}
/* s[i] = exp(s[i] - best) and lanes[i mod 16] += s[i], i in order */
static void exp_sum_generic(float *s, int64_t n, float best, float *lanes) {
    for (int64_t i = 0; i < n; i++) { s[i] = hexp(s[i] - best); lanes[i % LANES] = lanes[i % LANES] + s[i]; }
}

#ifdef HASTEN_X86
/* C queries at once against the KB = 32 keys (2C independent chains hide the FMA latency), each
 * a sequential fma over d */
#define DEFINE_SCORE_AVX512(C)                                                                                  \
    __attribute__((target("avx512f"))) static inline void score_chains_avx512_##C(                           \
        const float *qf, int64_t D, const float *kt, float *out) {                                           \
        __m512 s[C], u[C];                                                                                   \
        for (int c = 0; c < C; c++) s[c] = u[c] = _mm512_setzero_ps();                                       \
        for (int64_t d = 0; d < D; d++) {                                                                    \
            const __m512 k = _mm512_loadu_ps(kt + d * KB), k2 = _mm512_loadu_ps(kt + d * KB + 16);           \
            for (int c = 0; c < C; c++) {                                                                    \
                const __m512 q = _mm512_set1_ps(qf[c * D + d]);                                              \
                s[c] = _mm512_fmadd_ps(q, k, s[c]);                                                          \
                u[c] = _mm512_fmadd_ps(q, k2, u[c]);                                                         \
            }                                                                                                \
        }                                                                                                    \
        for (int c = 0; c < C; c++) { _mm512_storeu_ps(out + c * KB, s[c]); _mm512_storeu_ps(out + c * KB + 16, u[c]); } \
    }
DEFINE_SCORE_AVX512(1)
DEFINE_SCORE_AVX512(2)
DEFINE_SCORE_AVX512(3)
DEFINE_SCORE_AVX512(4)
DEFINE_SCORE_AVX512(8)

__attribute__((target("avx512f"))) static void score_block_avx512(const float *qf, int nq, int64_t D, const float *kt,
                                                                  float *out) {
    int a = 0;
    for (; a + 8 <= nq; a += 8) score_chains_avx512_8(qf + a * D, D, kt, out + a * KB);
    for (; a + 4 <= nq; a += 4) score_chains_avx512_4(qf + a * D, D, kt, out + a * KB);
    if (nq - a == 3) score_chains_avx512_3(qf + a * D, D, kt, out + a * KB);
    else if (nq - a == 2) score_chains_avx512_2(qf + a * D, D, kt, out + a * KB);
    else if (nq - a == 1) score_chains_avx512_1(qf + a * D, D, kt, out + a * KB);
}
__attribute__((target("avx512f"))) static inline __m512 hexp_avx512(__m512 x) { /* hexp, lane by lane */
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693145751953125f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.98412698412698413e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.38888888888888889e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.33333333333333333e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.16666666666666667e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.66666666666666667e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(_mm512_maskz_mov_ps(~tiny, n)), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(~tiny, p, _mm512_castsi512_ps(e));
}
__attribute__((target("avx512f"))) static void exp_sum_avx512(float *s, int64_t n, float best, float *lanes) {
    __m512 sum = _mm512_loadu_ps(lanes);
    const __m512 b = _mm512_set1_ps(best);
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        const __m512 p = hexp_avx512(_mm512_sub_ps(_mm512_loadu_ps(s + i), b));
        _mm512_storeu_ps(s + i, p);
        sum = _mm512_add_ps(sum, p);
    }
    _mm512_storeu_ps(lanes, sum);
    exp_sum_generic(s + i, n - i, best, lanes); /* the tail starts at lane 0: i is a multiple of 16 */
}
__attribute__((target("avx2,fma"))) static void score_block_avx2(const float *qf, int nq, int64_t D, const float *kt,
                                                                 float *out) {
    for (int a = 0; a < nq; a++)
        for (int h = 0; h < KB; h += 16) { /* 16 keys at a time */
            __m256 lo = _mm256_setzero_ps(), hi = lo;
            for (int64_t d = 0; d < D; d++) {
                const __m256 q = _mm256_set1_ps(qf[a * D + d]);
                lo = _mm256_fmadd_ps(q, _mm256_loadu_ps(kt + d * KB + h), lo);
                hi = _mm256_fmadd_ps(q, _mm256_loadu_ps(kt + d * KB + h + 8), hi);
            }
            _mm256_storeu_ps(out + a * KB + h, lo); _mm256_storeu_ps(out + a * KB + h + 8, hi);
        }
}
#endif

static void score_block(const float *qf, int nq, int64_t D, const float *kt, float *out) {
#ifdef HASTEN_X86
    if (cpu_path() == 2) { score_block_avx512(qf, nq, D, kt, out); return; }
    if (cpu_path() == 1) { score_block_avx2(qf, nq, D, kt, out); return; }
#endif
    score_block_generic(qf, nq, D, kt, out);
}
static void exp_sum(float *s, int64_t n, float best, float *lanes) {
#ifdef HASTEN_X86
    if (cpu_path() == 2) { exp_sum_avx512(s, n, best, lanes); return; }
#endif
    exp_sum_generic(s, n, best, lanes);
}

/* vf [count][D] += ... : acc [D] = fma(p[i], v[i][d], acc[d]) for i = 0..count-1 in order */
static void mix_block_generic(const float *p, int count, const float *vf, int64_t D, float *acc) {
    for (int i = 0; i < count; i++) for (int64_t d = 0; d < D; d++) acc[d] = fmaf(p[i], vf[i * D + d], acc[d]);
}
#ifdef HASTEN_X86
__attribute__((target("avx512f"))) static void mix_block_avx512(const float *p, int count, const float *vf, int64_t D,
                                                                float *acc) {
    int64_t d = 0;
    for (; d + 64 <= D; d += 64) { /* four vectors held across the block's keys */
        __m512 a0 = _mm512_loadu_ps(acc + d), a1 = _mm512_loadu_ps(acc + d + 16);
        __m512 a2 = _mm512_loadu_ps(acc + d + 32), a3 = _mm512_loadu_ps(acc + d + 48);
        for (int i = 0; i < count; i++) {
            const __m512 w = _mm512_set1_ps(p[i]);
            const float *v = vf + i * D + d;
            a0 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v), a0);
            a1 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 16), a1);
            a2 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 32), a2);
            a3 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 48), a3);
        }
        _mm512_storeu_ps(acc + d, a0); _mm512_storeu_ps(acc + d + 16, a1);
        _mm512_storeu_ps(acc + d + 32, a2); _mm512_storeu_ps(acc + d + 48, a3);
    }
    for (; d + 16 <= D; d += 16) {
        __m512 a0 = _mm512_loadu_ps(acc + d);
        for (int i = 0; i < count; i++) a0 = _mm512_fmadd_ps(_mm512_set1_ps(p[i]), _mm512_loadu_ps(vf + i * D + d), a0);
        _mm512_storeu_ps(acc + d, a0);
    }
    for (; d < D; d++) for (int i = 0; i < count; i++) acc[d] = fmaf(p[i], vf[i * D + d], acc[d]);
}
__attribute__((target("avx2,fma"))) static void mix_block_avx2(const float *p, int count, const float *vf, int64_t D,
                                                               float *acc) {
    int64_t d = 0;
    for (; d + 32 <= D; d += 32) {
        __m256 a0 = _mm256_loadu_ps(acc + d), a1 = _mm256_loadu_ps(acc + d + 8);
        __m256 a2 = _mm256_loadu_ps(acc + d + 16), a3 = _mm256_loadu_ps(acc + d + 24);
        for (int i = 0; i < count; i++) {
            const __m256 w = _mm256_set1_ps(p[i]);
            const float *v = vf + i * D + d;
            a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), a0);
            a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), a1);
            a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 16), a2);
            a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 24), a3);
        }
        _mm256_storeu_ps(acc + d, a0); _mm256_storeu_ps(acc + d + 8, a1);
        _mm256_storeu_ps(acc + d + 16, a2); _mm256_storeu_ps(acc + d + 24, a3);
    }
    for (; d < D; d++) for (int i = 0; i < count; i++) acc[d] = fmaf(p[i], vf[i * D + d], acc[d]);
}
#endif
#ifdef HASTEN_X86
/* two queries' outputs at once, sharing the value loads (eight chains); each as mix_block_avx512 */
__attribute__((target("avx512f"))) static void mix_pair_avx512(const float *p0, const float *p1, int count,
                                                               const float *vf, int64_t D, float *acc0, float *acc1) {
    if (D % 64) { mix_block_avx512(p0, count, vf, D, acc0); mix_block_avx512(p1, count, vf, D, acc1); return; }
    for (int64_t d = 0; d < D; d += 64) {
        __m512 a[4], b[4];
        for (int j = 0; j < 4; j++) { a[j] = _mm512_loadu_ps(acc0 + d + 16 * j); b[j] = _mm512_loadu_ps(acc1 + d + 16 * j); }
        for (int i = 0; i < count; i++) {
            const __m512 w0 = _mm512_set1_ps(p0[i]), w1 = _mm512_set1_ps(p1[i]);
            const float *v = vf + i * D + d;
            for (int j = 0; j < 4; j++) {
                const __m512 x = _mm512_loadu_ps(v + 16 * j);
                a[j] = _mm512_fmadd_ps(w0, x, a[j]);
                b[j] = _mm512_fmadd_ps(w1, x, b[j]);
            }
        }
        for (int j = 0; j < 4; j++) { _mm512_storeu_ps(acc0 + d + 16 * j, a[j]); _mm512_storeu_ps(acc1 + d + 16 * j, b[j]); }
    }
}
#endif

static void mix_block(const float *p, int count, const float *vf, int64_t D, float *acc) {
#ifdef HASTEN_X86
    if (cpu_path() == 2) { mix_block_avx512(p, count, vf, D, acc); return; }
    if (cpu_path() == 1) { mix_block_avx2(p, count, vf, D, acc); return; }
#endif
    mix_block_generic(p, count, vf, D, acc);
}
/* the queries q = 0..nq-1 (weights p + q * stride, outputs acc + q * D), two at a time where the path has it */
static void mix_queries(const float *p, int64_t stride, int nq, int count, const float *vf, int64_t D, float *acc) {
    int q = 0;
#ifdef HASTEN_X86
    if (cpu_path() == 2)
        for (; q + 2 <= nq; q += 2) mix_pair_avx512(p + q * stride, p + (q + 1) * stride, count, vf, D, acc + q * D, acc + (q + 1) * D);
#endif
    for (; q < nq; q++) mix_block(p + q * stride, count, vf, D, acc + q * D);
}

typedef struct {
    const void *q; int64_t q_row, q_head;           /* q[row, head, d] */
    const void *k, *v; int64_t kv_head, kv_pos;     /* k/v[kv_head, position, d] */
    void *out; int64_t o_row, o_head;               /* out[row, head, d] */
    int dtype, kv_dtype;
    int64_t rows, heads, kv_heads, dim, most;
    const int64_t *start, *prefix, *extra_offsets, *extra;
    float scale, softcap;
} attention_args;

static inline int64_t list_length(const attention_args *a, int64_t r) {
    return (a->prefix[r] - a->start[r]) + (a->extra_offsets ? a->extra_offsets[r + 1] - a->extra_offsets[r] : 0);
}
static inline int64_t list_key(const attention_args *a, int64_t r, int64_t i) {
    const int64_t run = a->prefix[r] - a->start[r];
    return i < run ? a->start[r] + i : a->extra[a->extra_offsets[r] + i - run];
}

typedef struct { /* one thread's scratch */
    float *qf;      /* [rows * group][D] the queries of one kv head */
    float *scores;  /* [rows * group][most] scores, then weights */
    float *acc;     /* [rows * group][D] */
    float *kt;      /* [D][KB] a key block, transposed */
    float *vf;      /* [KB][D] a value block */
    float *block;   /* [rows * group][KB] */
    float *total;   /* [rows * group] */
    int64_t keys[KB];
} scratch;

static inline float finish_score(const attention_args *a, float dot) {
    float s = dot * a->scale;
    if (a->softcap > 0.0f) s = a->softcap * htanh(s / a->softcap);
    return s;
}

#ifdef HASTEN_X86
__attribute__((target("avx512f"))) static void scale16_avx512(const float *dots, float scale, float *dst) {
    _mm512_storeu_ps(dst, _mm512_mul_ps(_mm512_loadu_ps(dots), _mm512_set1_ps(scale)));
}
__attribute__((target("avx512f"))) static float max_avx512(const float *s, int64_t n) {
    __m512 best = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) best = _mm512_max_ps(best, _mm512_loadu_ps(s + i));
    float m = _mm512_reduce_max_ps(best);
    for (; i < n; i++) m = s[i] > m ? s[i] : m;
    return m;
}
#endif

/* dst[l] = finish_score(dots[l]) for l < count (the same multiply, 16 at once where it can) */
static inline void finish_scores(const attention_args *a, const float *dots, int count, float *dst) {
#ifdef HASTEN_X86
    if (count == KB && a->softcap <= 0.0f && cpu_path() == 2) {
        for (int h = 0; h < KB; h += 16) scale16_avx512(dots + h, a->scale, dst + h);
        return;
    }
#endif
    for (int l = 0; l < count; l++) dst[l] = finish_score(a, dots[l]);
}

/* the largest of s[0..n) (a maximum is the same whatever the order it is taken in) */
static inline float scores_max(const float *s, int64_t n) {
#ifdef HASTEN_X86
    if (cpu_path() == 2) return max_avx512(s, n);
#endif
    float best = -INFINITY;
    for (int64_t i = 0; i < n; i++) best = s[i] > best ? s[i] : best;
    return best;
}

#ifdef HASTEN_X86
/* dst[i * KB + l] = src[l * stride + i] for i, l < 16: a 16 x 16 transpose in registers (data
 * movement only: the numbers the scores are computed from are the same) */
__attribute__((target("avx512f"))) static void transpose16_avx512(const float *src, int64_t stride, float *dst) {
    __m512 r[16], t[16];
    for (int l = 0; l < 16; l++) r[l] = _mm512_loadu_ps(src + l * stride);
    for (int l = 0; l < 16; l += 2) { t[l] = _mm512_unpacklo_ps(r[l], r[l + 1]); t[l + 1] = _mm512_unpackhi_ps(r[l], r[l + 1]); }
    for (int l = 0; l < 16; l += 4) {
        r[l] = _mm512_shuffle_ps(t[l], t[l + 2], 0x44); r[l + 1] = _mm512_shuffle_ps(t[l], t[l + 2], 0xEE);
        r[l + 2] = _mm512_shuffle_ps(t[l + 1], t[l + 3], 0x44); r[l + 3] = _mm512_shuffle_ps(t[l + 1], t[l + 3], 0xEE);
    }
    for (int h = 0; h < 16; h += 8)
        for (int j = 0; j < 4; j++) {
            t[h + j] = _mm512_shuffle_f32x4(r[h + j], r[h + j + 4], 0x88);
            t[h + j + 4] = _mm512_shuffle_f32x4(r[h + j], r[h + j + 4], 0xDD);
        }
    for (int j = 0; j < 8; j++) {
        _mm512_storeu_ps(dst + j * KB, _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88));
        _mm512_storeu_ps(dst + (j + 8) * KB, _mm512_shuffle_f32x4(t[j], t[j + 8], 0xDD));
    }
}
#endif

/* keys[0..count) of kv head kvh: transposed into kt [D][KB] (lanes past count zero) and values into vf [count][D] */
static void load_block(const attention_args *a, int64_t kvh, const int64_t *keys, int count, scratch *w, int values) {
    const int64_t D = a->dim;
    for (int l = 0; l < count; l++) load_row(a->k, kvh * a->kv_head + keys[l] * a->kv_pos, D, a->kv_dtype, w->vf + l * D);
    for (int l = count; l < KB; l++) memset(w->vf + l * D, 0, sizeof(float) * (size_t)D);
#ifdef HASTEN_X86
    if (cpu_path() == 2 && D % 16 == 0) {
        for (int h = 0; h < KB; h += 16)
            for (int64_t d = 0; d < D; d += 16) transpose16_avx512(w->vf + h * D + d, D, w->kt + d * KB + h);
    } else
#endif
        for (int l = 0; l < KB; l++)
            for (int64_t d = 0; d < D; d++) w->kt[d * KB + l] = w->vf[l * D + d];
    if (values)
        for (int l = 0; l < count; l++) load_row(a->v, kvh * a->kv_head + keys[l] * a->kv_pos, D, a->kv_dtype, w->vf + l * D);
}

/* Everything of one kv head: the queries of rows [r0, r1) (those sharing a start) and their group's heads.
 * Query slot qs = (r - r0) * group + h. */
static void attend_kv_head(const attention_args *a, int64_t kvh, int64_t r0, int64_t r1, scratch *w) {
    const int64_t group = a->heads / a->kv_heads, D = a->dim, begin = a->start[r0];
    int64_t shared = a->prefix[r0];
    for (int64_t r = r0; r < r1; r++) if (a->prefix[r] < shared) shared = a->prefix[r];
    const int nq = (int)((r1 - r0) * group);
    for (int64_t r = r0; r < r1; r++)
        for (int64_t h = 0; h < group; h++)
            load_row(a->q, r * a->q_row + (kvh * group + h) * a->q_head, D, a->dtype, w->qf + ((r - r0) * group + h) * D);
    /* rows whose lists are one run from begin (a prefill, a chain block): the keys past the shared
     * run are scored once for every query too (a row's scores past its own list go unread) */
    int contiguous = 1;
    int64_t upto = shared;
    for (int64_t r = r0; r < r1; r++) {
        if (a->extra_offsets && a->extra_offsets[r + 1] != a->extra_offsets[r]) contiguous = 0;
        if (a->prefix[r] > upto) upto = a->prefix[r];
    }
    const int64_t scored = contiguous ? upto : shared;
    /* scores: the shared run once for every query, then each row's own keys */
    for (int64_t j0 = begin; j0 < scored; j0 += KB) {
        const int count = (int)(scored - j0 < KB ? scored - j0 : KB);
        for (int l = 0; l < count; l++) w->keys[l] = j0 + l;
        load_block(a, kvh, w->keys, count, w, 0);
        score_block(w->qf, nq, D, w->kt, w->block);
        for (int q = 0; q < nq; q++)
            finish_scores(a, w->block + q * KB, count, w->scores + q * a->most + (j0 - begin));
    }
    for (int64_t r = r0; r < r1; r++) {
        const int64_t n = list_length(a, r);
        for (int64_t i0 = scored - begin; i0 < n; i0 += KB) {
            const int count = (int)(n - i0 < KB ? n - i0 : KB);
            for (int l = 0; l < count; l++) w->keys[l] = list_key(a, r, i0 + l);
            load_block(a, kvh, w->keys, count, w, 0);
            score_block(w->qf + (r - r0) * group * D, (int)group, D, w->kt, w->block);
            for (int64_t h = 0; h < group; h++)
                finish_scores(a, w->block + h * KB, count, w->scores + ((r - r0) * group + h) * a->most + i0);
        }
    }
    /* weights: exp(s - max), summed by lanes of list position */
    float *total = w->total;
    for (int q = 0; q < nq; q++) {
        float *s = w->scores + q * a->most;
        const int64_t n = list_length(a, r0 + q / group);
        const float best = scores_max(s, n);
        float lanes[LANES];
        for (int l = 0; l < LANES; l++) lanes[l] = 0.0f;
        exp_sum(s, n, best, lanes);
        total[q] = lanes_sum(lanes);
        for (int64_t d = 0; d < D; d++) w->acc[q * D + d] = 0.0f;
    }
    /* values: the shared run once, then each row's own keys, each output in list order */
    for (int64_t j0 = begin; j0 < shared; j0 += KB) {
        const int count = (int)(shared - j0 < KB ? shared - j0 : KB);
        for (int l = 0; l < count; l++) load_row(a->v, kvh * a->kv_head + (j0 + l) * a->kv_pos, D, a->kv_dtype, w->vf + l * D);
        mix_queries(w->scores + (j0 - begin), a->most, nq, count, w->vf, D, w->acc);
    }
    for (int64_t j0 = shared; contiguous && j0 < upto; j0 += KB) { /* one run: each value block loaded once */
        const int count = (int)(upto - j0 < KB ? upto - j0 : KB);
        for (int l = 0; l < count; l++) load_row(a->v, kvh * a->kv_head + (j0 + l) * a->kv_pos, D, a->kv_dtype, w->vf + l * D);
        for (int64_t r = r0; r < r1; r++) {
            const int64_t seen = a->prefix[r] - j0; /* of this block's keys, those in row r's list */
            const int64_t q0 = (r - r0) * group;
            if (seen > 0)
                mix_queries(w->scores + q0 * a->most + (j0 - begin), a->most, (int)group, (int)(seen < count ? seen : count),
                            w->vf, D, w->acc + q0 * D);
        }
    }
    for (int64_t r = r0; r < r1 && !contiguous; r++) {
        const int64_t n = list_length(a, r);
        for (int64_t i0 = shared - begin; i0 < n; i0 += KB) {
            const int count = (int)(n - i0 < KB ? n - i0 : KB);
            for (int l = 0; l < count; l++)
                load_row(a->v, kvh * a->kv_head + list_key(a, r, i0 + l) * a->kv_pos, D, a->kv_dtype, w->vf + l * D);
            const int64_t q0 = (r - r0) * group;
            mix_queries(w->scores + q0 * a->most + i0, a->most, (int)group, count, w->vf, D, w->acc + q0 * D);
        }
    }
    for (int q = 0; q < nq; q++) {
        const int64_t r = r0 + q / group, h = kvh * group + q % group, n = list_length(a, r);
        const int64_t obase = r * a->o_row + h * a->o_head;
        for (int64_t d = 0; d < D; d++) store1(a->out, obase + d, n > 0 ? w->acc[q * D + d] / total[q] : 0.0f, a->dtype);
    }
}

#ifdef HASTEN_AMX
/* ---- attention on AMX tiles (bfloat16 queries and keys/values, where bfloat16 layers take AMX) --
 * A contract of its own, like the AMX linear layer's, in the same process-wide switch:
 *   score s_i = tdpbf16ps over the head's dimensions in chunks of 32 (in order) of q and k_{j_i},
 *              then * scale (softcap as above): each score from its own query and key alone;
 *   p_i, l    = as the contract above (exp, 16 lanes, in float32);
 *   o[d]      = round((tdpbf16ps over list positions in chunks of 32 from the list's start, in
 *              order, of bf16(p_i) and v_{j_i}[d]) / l)   (bf16: VCVTNEPS2BF16, to nearest even)
 * Row invariant by construction for the reasons the linear layer's is (each tile element from its
 * own A row, B column and accumulator; tiles always 16 x 64 bytes): a query row shares its A tile
 * with other rows or zeros, and list positions past a row's own list weigh exactly zero (p = 0,
 * values zero past the keys), so a row gets the bits it gets alone. */
#define AMX_KEYS 32 /* list positions per chunk: an A tile row of bfloat16 weights; keys per K block */

typedef struct { /* one thread's AMX scratch, next to the float32 path's */
    uint16_t *qb;   /* [queries, padded to 16][D] */
    uint16_t *kb;   /* [AMX_KEYS][D] a key block's rows */
    uint32_t *kt;   /* [D / 2][AMX_KEYS] the block as B tiles: dimension pairs x keys */
    float *sb;      /* [16][AMX_KEYS] one tile of scores */
    uint32_t *vb;   /* [positions / 2][D] the values as B tiles: position pairs x dimensions */
    uint16_t *pb;   /* [16][positions] one query tile's weights */
    int64_t *seq;   /* [most] the keys, in list order */
} amx_scratch;

/* scores of 16 queries (qb rows, D bf16 each) against 32 keys (kt) -> sb [16][32] */
__attribute__((target("amx-tile,amx-bf16"))) static void amx_scores(const uint16_t *qb, int64_t D, const uint32_t *kt,
                                                                    float *sb) {
    __asm__ __volatile__("" ::: "memory");
    _tile_zero(4); _tile_zero(5);
    for (int64_t c = 0; c < D / 32; c++) { /* 32 dimensions (16 pairs) a chunk, in order */
        _tile_loadd(0, qb + 32 * c, D * 2);
        _tile_loadd(1, kt + 16 * c * AMX_KEYS, AMX_KEYS * 4);      _tile_dpbf16ps(4, 0, 1);
        _tile_loadd(2, kt + 16 * c * AMX_KEYS + 16, AMX_KEYS * 4); _tile_dpbf16ps(5, 0, 2);
    }
    _tile_stored(4, sb, AMX_KEYS * 4); _tile_stored(5, sb + 16, AMX_KEYS * 4);
    __asm__ __volatile__("" ::: "memory");
}

/* 16 queries' weights (pb [16][stride] bf16, positions 0..m_pad) against the values (vb) for
 * dimensions [d0, d0 + 16 * groups), groups <= 4 -> acc [16][D] at those dimensions */
__attribute__((target("amx-tile,amx-bf16"))) static void amx_mix(const uint16_t *pb, int64_t stride, int64_t m_pad,
                                                                 const uint32_t *vb, int64_t D, int64_t d0, int groups,
                                                                 float *acc) {
    __asm__ __volatile__("" ::: "memory");
    _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
    for (int64_t i0 = 0; i0 < m_pad; i0 += AMX_KEYS) {
        _tile_loadd(0, pb + i0, stride * 2);
        const uint32_t *b = vb + (i0 / 2) * D + d0;
        _tile_loadd(1, b, D * 4); _tile_dpbf16ps(4, 0, 1);
        if (groups > 1) { _tile_loadd(2, b + 16, D * 4); _tile_dpbf16ps(5, 0, 2); }
        if (groups > 2) { _tile_loadd(3, b + 32, D * 4); _tile_dpbf16ps(6, 0, 3); }
        if (groups > 3) { _tile_loadd(1, b + 48, D * 4); _tile_dpbf16ps(7, 0, 1); }
    }
    _tile_stored(4, acc + d0, D * 4);
    if (groups > 1) _tile_stored(5, acc + d0 + 16, D * 4);
    if (groups > 2) _tile_stored(6, acc + d0 + 32, D * 4);
    if (groups > 3) _tile_stored(7, acc + d0 + 48, D * 4);
    __asm__ __volatile__("" ::: "memory");
}

/* two value rows (positions 2k, 2k + 1) interleaved as one B tile row: out[d] = a[d] | b[d] << 16 */
__attribute__((target("avx512f,avx512bw"))) static void interleave_rows(const uint16_t *a, const uint16_t *b, int64_t D,
                                                                        uint32_t *out) {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5,
                                        36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t d = 0; d < D; d += 32) {
        const __m512i x = _mm512_loadu_si512((const void *)(a + d)), y = _mm512_loadu_si512((const void *)(b + d));
        _mm512_storeu_si512((void *)(out + d), _mm512_permutex2var_epi16(x, lo, y));
        _mm512_storeu_si512((void *)(out + d + 16), _mm512_permutex2var_epi16(x, hi, y));
    }
}

/* dst [16][stride] bf16 = bf16(s[i]) for i < n, zero for n <= i < m_pad (VCVTNEPS2BF16) */
__attribute__((target("avx512f,avx512bf16,avx512bw"))) static void weights_bf16(const float *s, int64_t n, int64_t m_pad,
                                                                                uint16_t *dst) {
    for (int64_t i = 0; i < m_pad; i += 16) {
        const int64_t left = n - i;
        const __mmask16 keep = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
        const __m512 p = _mm512_maskz_loadu_ps(keep, s + i);
        _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(p));
    }
}

/* the queries of rows [r0, r1) (each row's group heads) over one key sequence seq[0..m) that each
 * row's list begins with (its first list_length positions) */
static void amx_sequence(const attention_args *a, int64_t kvh, int64_t r0, int64_t r1, const int64_t *seq, int64_t m,
                         scratch *w, amx_scratch *x) {
    const int64_t group = a->heads / a->kv_heads, D = a->dim, nq = (r1 - r0) * group;
    const int64_t tiles = (nq + 15) / 16, m_pad = (m + AMX_KEYS - 1) / AMX_KEYS * AMX_KEYS;
    memset(x->qb, 0, sizeof(uint16_t) * (size_t)(tiles * 16 * D));
    for (int64_t q = 0; q < nq; q++) {
        const int64_t r = r0 + q / group, h = kvh * group + q % group;
        memcpy(x->qb + q * D, (const uint16_t *)a->q + r * a->q_row + h * a->q_head, sizeof(uint16_t) * (size_t)D);
    }
    const uint16_t *keys = (const uint16_t *)a->k + kvh * a->kv_head, *values = (const uint16_t *)a->v + kvh * a->kv_head;
    /* scores, 32 keys at a time */
    for (int64_t i0 = 0; i0 < m; i0 += AMX_KEYS) {
        const int count = (int)(m - i0 < AMX_KEYS ? m - i0 : AMX_KEYS);
        for (int l = 0; l < AMX_KEYS; l++) {
            if (l < count) memcpy(x->kb + l * D, keys + seq[i0 + l] * a->kv_pos, sizeof(uint16_t) * (size_t)D);
            else memset(x->kb + l * D, 0, sizeof(uint16_t) * (size_t)D);
        }
        for (int h = 0; h < AMX_KEYS; h += 16) /* [keys][D / 2 pairs] -> [pairs][keys] */
            for (int64_t p = 0; p < D / 2; p += 16)
                transpose16_avx512((const float *)x->kb + h * (D / 2) + p, D / 2, (float *)x->kt + p * AMX_KEYS + h);
        for (int64_t t = 0; t < tiles; t++) {
            amx_scores(x->qb + t * 16 * D, D, x->kt, x->sb);
            for (int64_t q = t * 16; q < nq && q < t * 16 + 16; q++) {
                const int64_t n = list_length(a, r0 + q / group);
                if (i0 < n) finish_scores(a, x->sb + (q - t * 16) * AMX_KEYS, (int)(n - i0 < count ? n - i0 : count),
                                          w->scores + q * a->most + i0);
            }
        }
    }
    /* weights: exp(s - max), summed by lanes of list position (the float32 path's) */
    for (int64_t q = 0; q < nq; q++) {
        float *s = w->scores + q * a->most;
        const int64_t n = list_length(a, r0 + q / group);
        float lanes[LANES];
        for (int l = 0; l < LANES; l++) lanes[l] = 0.0f;
        exp_sum(s, n, scores_max(s, n), lanes);
        w->total[q] = lanes_sum(lanes);
    }
    /* values as B tiles, zero past the sequence */
    for (int64_t k = 0; k < m_pad / 2; k++) {
        const int64_t i = 2 * k;
        if (i + 1 < m) interleave_rows(values + seq[i] * a->kv_pos, values + seq[i + 1] * a->kv_pos, D, x->vb + k * D);
        else if (i < m) { /* the last key alone: its partner zero */
            const uint16_t *v = values + seq[i] * a->kv_pos;
            for (int64_t d = 0; d < D; d++) x->vb[k * D + d] = v[d];
        } else memset(x->vb + k * D, 0, sizeof(uint32_t) * (size_t)D);
    }
    float acc[16 * 512];
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t row = 0; row < 16; row++) {
            const int64_t q = t * 16 + row;
            const int64_t n = q < nq ? list_length(a, r0 + q / group) : 0;
            weights_bf16(w->scores + (q < nq ? q : 0) * a->most, n, m_pad, x->pb + row * m_pad);
        }
        for (int64_t d0 = 0; d0 < D; d0 += 64)
            amx_mix(x->pb, m_pad, m_pad, x->vb, D, d0, (int)((D - d0) / 16 < 4 ? (D - d0) / 16 : 4), acc);
        for (int64_t q = t * 16; q < nq && q < t * 16 + 16; q++) {
            const int64_t r = r0 + q / group, h = kvh * group + q % group, n = list_length(a, r);
            const int64_t obase = r * a->o_row + h * a->o_head;
            const float *o = acc + (q - t * 16) * D;
            for (int64_t d = 0; d < D; d++) store1(a->out, obase + d, n > 0 ? o[d] / w->total[q] : 0.0f, a->dtype);
        }
    }
}

/* a work item on AMX: one sequence for rows whose lists are one run from the same start (a
 * prefill, a chain block), else each row over its own list */
static void attend_kv_head_amx(const attention_args *a, int64_t kvh, int64_t r0, int64_t r1, scratch *w,
                               amx_scratch *x) {
    int contiguous = 1;
    int64_t upto = a->start[r0];
    for (int64_t r = r0; r < r1; r++) {
        if (a->extra_offsets && a->extra_offsets[r + 1] != a->extra_offsets[r]) contiguous = 0;
        if (a->prefix[r] > upto) upto = a->prefix[r];
    }
    if (contiguous) {
        const int64_t m = upto - a->start[r0];
        for (int64_t i = 0; i < m; i++) x->seq[i] = a->start[r0] + i;
        amx_sequence(a, kvh, r0, r1, x->seq, m, w, x);
        return;
    }
    for (int64_t r = r0; r < r1; r++) {
        const int64_t m = list_length(a, r);
        for (int64_t i = 0; i < m; i++) x->seq[i] = list_key(a, r, i);
        amx_sequence(a, kvh, r, r + 1, x->seq, m, w, x);
    }
}
#endif

#define ROW_CHUNK 32 /* query rows per work item: bounds the scratch and spreads a prefill over threads */

int hasten_attention(const void *q, int64_t q_row, int64_t q_head, const void *k, const void *v, int64_t kv_head,
                     int64_t kv_pos, void *out, int64_t o_row, int64_t o_head, int dtype, int kv_dtype, int64_t rows,
                     int64_t heads, int64_t kv_heads, int64_t dim, const int64_t *start, const int64_t *prefix,
                     const int64_t *extra_offsets, const int64_t *extra, float scale, float softcap, int threads,
                     int amx) {
    if (kv_heads < 1 || heads % kv_heads != 0) return -1;
#ifdef HASTEN_AMX
    if (amx && (!hasten_amx_available() || !hasten_bf16_dot_available() || dtype != BF16 || kv_dtype != BF16 ||
                dim % 32 || dim > 512))
        return -3;
#else
    if (amx) return -3;
#endif
    attention_args a = {q, q_row, q_head, k, v, kv_head, kv_pos, out, o_row, o_head, dtype, kv_dtype, rows, heads,
                        kv_heads, dim, 1, start, prefix, extra_offsets, extra, scale, softcap};
    for (int64_t r = 0; r < rows; r++) { const int64_t n = list_length(&a, r); if (n > a.most) a.most = n; }
    /* work items: (kv head, run of at most ROW_CHUNK rows sharing a start) */
    int64_t *runs = (int64_t *)malloc(sizeof(int64_t) * (size_t)(rows + 1)), nruns = 0;
    if (!runs) return -2;
    for (int64_t r = 0; r < rows; r++)
        if (r == 0 || start[r] != start[r - 1] || r - runs[nruns - 1] >= ROW_CHUNK) runs[nruns++] = r;
    runs[nruns] = rows;
    const int64_t group = heads / kv_heads, work = kv_heads * nruns;
    int failed = 0;
#pragma omp parallel num_threads(threads_for(threads, work))
    {
        scratch w;
        const size_t slots = (size_t)((rows < ROW_CHUNK ? rows : ROW_CHUNK) * group);
        w.qf = (float *)malloc(sizeof(float) * slots * (size_t)dim);
        w.scores = (float *)malloc(sizeof(float) * slots * (size_t)a.most);
        w.acc = (float *)malloc(sizeof(float) * slots * (size_t)dim);
        w.kt = (float *)malloc(sizeof(float) * (size_t)(dim * KB));
        w.vf = (float *)malloc(sizeof(float) * (size_t)(dim * KB));
        w.block = (float *)malloc(sizeof(float) * slots * KB);
        w.total = (float *)malloc(sizeof(float) * slots);
        if (!w.qf || !w.scores || !w.acc || !w.kt || !w.vf || !w.block || !w.total) {
#pragma omp atomic write
            failed = 1;
        }
#ifdef HASTEN_AMX
        amx_scratch x = {0};
        if (amx) {
            const size_t padded = (size_t)((a.most + AMX_KEYS - 1) / AMX_KEYS * AMX_KEYS), tile_rows = (slots + 15) / 16 * 16;
            x.qb = (uint16_t *)malloc(sizeof(uint16_t) * tile_rows * (size_t)dim);
            x.kb = (uint16_t *)malloc(sizeof(uint16_t) * AMX_KEYS * (size_t)dim);
            x.kt = (uint32_t *)malloc(sizeof(uint32_t) * AMX_KEYS * (size_t)(dim / 2));
            x.sb = (float *)malloc(sizeof(float) * 16 * AMX_KEYS);
            x.vb = (uint32_t *)malloc(sizeof(uint32_t) * (padded / 2) * (size_t)dim);
            x.pb = (uint16_t *)malloc(sizeof(uint16_t) * 16 * padded);
            x.seq = (int64_t *)malloc(sizeof(int64_t) * (size_t)a.most);
            if (!x.qb || !x.kb || !x.kt || !x.sb || !x.vb || !x.pb || !x.seq) {
#pragma omp atomic write
                failed = 1;
            }
            amx_configure();
        }
#endif
#pragma omp for schedule(static)
        for (int64_t item = 0; item < work; item++) {
            if (failed) continue;
#ifdef HASTEN_AMX
            if (amx) { attend_kv_head_amx(&a, item % kv_heads, runs[item / kv_heads], runs[item / kv_heads + 1], &w, &x); continue; }
#endif
            attend_kv_head(&a, item % kv_heads, runs[item / kv_heads], runs[item / kv_heads + 1], &w);
        }
#ifdef HASTEN_AMX
        if (amx) {
            amx_release();
            free(x.qb); free(x.kb); free(x.kt); free(x.sb); free(x.vb); free(x.pb); free(x.seq);
        }
#endif
        free(w.qf); free(w.scores); free(w.acc); free(w.kt); free(w.vf); free(w.block); free(w.total);
    }
    free(runs);
    return failed ? -2 : 0;
}

/* ============================ norm and rotary (the step's glue) ============================== */
/* One call each where PyTorch takes five to eight small operations. The rotary embedding is
 * transformers' own arithmetic, operation for operation, each result rounded to the tensors'
 * format as PyTorch's CPU operators round it (computed in float32, rounded to nearest even), so
 * it gives PyTorch's bits. The norm is a contract of its own (PyTorch's sum of squares goes in
 * an order that depends on the CPU's vector width):
 *   rms norm:  h = float(x) (with a residual: x = round(residual + delta) first, stored)
 *              ss = sum of h_i * h_i: 16 lanes by i mod 16, fma in i order, then summed pairwise
 *              y_i = round(h_i * (1 / sqrt(ss / n + eps)));  out_i = round_out(weight_i * y_i)
 * The AVX-512 and AVX2 builds of the norm are the portable code compiled for those instruction
 * sets (the same operations; fmaf is correctly rounded wherever it runs), so the bits do not
 * depend on the CPU. */

/* v[0..n) rounded to the format and back (each loop one format, so it vectorizes) */
static inline void round_row(float *v, int64_t n, int dtype) {
    if (dtype == BF16) for (int64_t i = 0; i < n; i++) v[i] = bf16_to_f32(f32_to_bf16(v[i]));
    else if (dtype == FP16) for (int64_t i = 0; i < n; i++) v[i] = fp16_to_f32(f32_to_fp16(v[i]));
}
static inline void store_row(void *p, int64_t offset, int64_t n, int dtype, const float *src) {
    if (dtype == BF16) for (int64_t i = 0; i < n; i++) ((uint16_t *)p)[offset + i] = f32_to_bf16(src[i]);
    else if (dtype == FP16) for (int64_t i = 0; i < n; i++) ((uint16_t *)p)[offset + i] = f32_to_fp16(src[i]);
    else memcpy((float *)p + offset, src, sizeof(float) * (size_t)n);
}

/* the norm of one row, as the contract above writes it; h, t: scratch of n floats, weight: as float32 */
static inline __attribute__((always_inline)) void rms_row(const void *x, int64_t xo, const void *delta, int64_t doff,
                                                         void *residual_out, int64_t ro, int dtype, const float *weight,
                                                         void *out, int64_t oo, int ot, int64_t n, float eps, float *h,
                                                         float *t) {
    load_row(x, xo, n, dtype, h);
    if (delta) {
        load_row(delta, doff, n, dtype, t);
        for (int64_t i = 0; i < n; i++) h[i] = h[i] + t[i];
        round_row(h, n, dtype);
        store_row(residual_out, ro, n, dtype, h);
    }
    float lanes[LANES];
    for (int l = 0; l < LANES; l++) lanes[l] = 0.0f;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) lanes[l] = fmaf(h[i + l], h[i + l], lanes[l]);
    for (int l = 0; i < n; i++, l++) lanes[l] = fmaf(h[i], h[i], lanes[l]);
    const float inverse = 1.0f / sqrtf(lanes_sum(lanes) / (float)n + eps);
    for (int64_t j = 0; j < n; j++) t[j] = h[j] * inverse;
    round_row(t, n, dtype);
    for (int64_t j = 0; j < n; j++) t[j] = weight[j] * t[j];
    store_row(out, oo, n, ot, t);
}

#define RMS_ROWS_BODY                                                                                      \
    for (int64_t r = 0; r < rows; r++)                                                                    \
        rms_row(x, r * sx, delta, r * sd, residual_out, r * sr, dtype, weight, out, r * so, ot, n, eps, h, t);
static void rms_rows_generic(const void *x, int64_t sx, const void *delta, int64_t sd, void *residual_out, int64_t sr,
                             int dtype, const float *weight, void *out, int64_t so, int ot, int64_t rows, int64_t n,
                             float eps, float *h, float *t) { RMS_ROWS_BODY }
#ifdef HASTEN_X86
/* the same operations, compiled for AVX-512 (fmaf one instruction, the loops 16 lanes wide) */
__attribute__((target("avx512f,fma"))) static void rms_rows_avx512(const void *x, int64_t sx, const void *delta, int64_t sd,
                                                                   void *residual_out, int64_t sr, int dtype,
                                                                   const float *weight, void *out, int64_t so, int ot,
                                                                   int64_t rows, int64_t n, float eps, float *h, float *t) {
    RMS_ROWS_BODY
}
__attribute__((target("avx2,fma,f16c"))) static void rms_rows_avx2(const void *x, int64_t sx, const void *delta, int64_t sd,
                                                                   void *residual_out, int64_t sr, int dtype,
                                                                   const float *weight, void *out, int64_t so, int ot,
                                                                   int64_t rows, int64_t n, float eps, float *h, float *t) {
    RMS_ROWS_BODY
}
#endif

/* rows of n values: x [rows] (row stride sx); delta/residual_out NULL, or x = round(x + delta)
 * is stored in residual_out (stride sr) first; out (stride so, format ot) the normed rows.
 * 0, or -2 out of memory */
int hasten_rms_norm(const void *x, int64_t sx, const void *delta, int64_t sd, void *residual_out, int64_t sr,
                    int dtype, const void *w, int wt, void *out, int64_t so, int ot, int64_t rows, int64_t n,
                    float eps) {
    const size_t bytes = sizeof(float) * (size_t)(n > 0 ? n : 1);
    float *h = (float *)malloc(bytes), *weight = (float *)malloc(bytes), *t = (float *)malloc(bytes);
    if (!h || !weight || !t) { free(h); free(weight); free(t); return -2; }
    load_row(w, 0, n, wt, weight);
#ifdef HASTEN_X86
    if (cpu_path() == 2) rms_rows_avx512(x, sx, delta, sd, residual_out, sr, dtype, weight, out, so, ot, rows, n, eps, h, t);
    else if (cpu_path() == 1) rms_rows_avx2(x, sx, delta, sd, residual_out, sr, dtype, weight, out, so, ot, rows, n, eps, h, t);
    else
#endif
        rms_rows_generic(x, sx, delta, sd, residual_out, sr, dtype, weight, out, so, ot, rows, n, eps, h, t);
    free(h); free(weight); free(t);
    return 0;
}

/* transformers' rotary embedding of one vector v [D] (float32 values of the format): out =
 * round(round(v * cos) + round(rotate_half(v) * sin)), rotate_half(v)[d] = -v[d + D/2] for
 * d < D/2, else v[d - D/2]; t, u: scratch of D floats */
static inline __attribute__((always_inline)) void rotate_vector(const float *v, const float *c, const float *s, int64_t D,
                                                               int dtype, float *t, float *u) {
    const int64_t half = D / 2;
    for (int64_t d = 0; d < D; d++) t[d] = c[d] * v[d];
    for (int64_t d = 0; d < half; d++) u[d] = -v[d + half] * s[d];
    for (int64_t d = half; d < D; d++) u[d] = v[d - half] * s[d];
    round_row(t, D, dtype);
    round_row(u, D, dtype);
    for (int64_t d = 0; d < D; d++) t[d] = t[d] + u[d];
}

#define ROTARY_BODY                                                                                           \
    float c[512], sn[512], v[512], t[512], u[512];                                                            \
    for (int64_t r = 0; r < rows; r++) {                                                                      \
        load_row(cos, r * sc, D, dtype, c);                                                                   \
        load_row(sin, r * sc, D, dtype, sn);                                                                  \
        for (int64_t hd = 0; hd < heads; hd++) {                                                              \
            load_row(x, r * sx_row + hd * sx_head, D, dtype, v);                                              \
            rotate_vector(v, c, sn, D, dtype, t, u);                                                          \
            store_row(out, r * so_row + hd * so_head, D, dtype, t);                                           \
        }                                                                                                     \
    }
static void rotary_generic(const void *x, int64_t sx_row, int64_t sx_head, const void *cos, const void *sin, int64_t sc,
                           void *out, int64_t so_row, int64_t so_head, int dtype, int64_t rows, int64_t heads,
                           int64_t D) { ROTARY_BODY }
#ifdef HASTEN_X86
__attribute__((target("avx512f"))) static void rotary_avx512(const void *x, int64_t sx_row, int64_t sx_head,
                                                             const void *cos, const void *sin, int64_t sc, void *out,
                                                             int64_t so_row, int64_t so_head, int dtype, int64_t rows,
                                                             int64_t heads, int64_t D) { ROTARY_BODY }
#endif

/* the rotary embedding of rows x heads vectors of D (row and head strides of their own), cos and
 * sin [rows][D] (row stride sc), all in one format. 0, or -1 for D odd or over 512 */
int hasten_rotary(const void *x, int64_t sx_row, int64_t sx_head, const void *cos, const void *sin, int64_t sc,
                  void *out, int64_t so_row, int64_t so_head, int dtype, int64_t rows, int64_t heads, int64_t D) {
    if (D > 512 || D % 2) return -1;
#ifdef HASTEN_X86
    if (cpu_path() == 2) { rotary_avx512(x, sx_row, sx_head, cos, sin, sc, out, so_row, so_head, dtype, rows, heads, D); return 0; }
#endif
    rotary_generic(x, sx_row, sx_head, cos, sin, sc, out, so_row, so_head, dtype, rows, heads, D);
    return 0;
}
