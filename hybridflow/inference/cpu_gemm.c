/* The native engine's bf16 matmuls on CPUs with avx512_bf16 (hybridflow/inference/cpu_gemm.py says why).
 *
 * y (M, N) = x (M, K) W^T (+ bias) (+ residual), bf16 in and out. Each output is a float32 sum over K in ascending
 * pairs of k (vdpbf16ps), restarted from zero every k_block values of k with the blocks' sums added in order, plus
 * the bias and then the residual, rounded once to bf16 (round to nearest even). That is oneDNN's order for the same
 * product on these CPUs, so the results are oneDNN's to the bit (cpu_gemm.py finds k_block by comparing with it),
 * and no output depends on M or on the other rows: the order is the same for every row count.
 *
 * Weights are packed once (hf_pack) into panels of up to 48 columns (3 vectors of 16): panel after panel, and in
 * each, k-pair after k-pair, the panel's columns' two bf16 values, so a panel streams from memory in one pass, which
 * the hardware prefetcher follows (software prefetching measured slower). A register tile is up to 8 rows x 48
 * columns: 24 accumulators of 32. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define PANEL 48

void hf_pack(const uint16_t *w, int64_t ldw, uint16_t *out, int64_t n, int64_t k) {
    for (int64_t n0 = 0; n0 < n; n0 += PANEL) {
        int64_t width = n - n0 < PANEL ? n - n0 : PANEL;
        for (int64_t kp = 0; kp < k / 2; kp++)
            for (int64_t j = 0; j < width; j++) {
                *out++ = w[(n0 + j) * ldw + 2 * kp];
                *out++ = w[(n0 + j) * ldw + 2 * kp + 1];
            }
    }
}

static inline __m512 widen(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

#define KERNEL(MR, NZ)                                                                                              \
    static void kernel_##MR##_##NZ(const uint16_t *x, int64_t ldx, const uint16_t *panel, int64_t k, int64_t kb,  \
                                   uint16_t *y, int64_t ldy, const uint16_t *bias, const uint16_t *res,            \
                                   int64_t ldr) {                                                                   \
        __m512 total[MR][NZ], acc[MR][NZ];                                                                          \
        const int64_t pairs = k / 2, block = kb / 2;                                                                \
        for (int m = 0; m < MR; m++)                                                                                \
            for (int z = 0; z < NZ; z++) total[m][z] = _mm512_setzero_ps(); /* the first block replaces it */     \
        for (int64_t k0 = 0; k0 < pairs; k0 += block) {                                                            \
            const int64_t k1 = k0 + block < pairs ? k0 + block : pairs;                                            \
            for (int m = 0; m < MR; m++)                                                                            \
                for (int z = 0; z < NZ; z++) acc[m][z] = _mm512_setzero_ps();                                       \
            for (int64_t kp = k0; kp < k1; kp++) {                                                                  \
                const uint16_t *wp = panel + kp * NZ * 32;                                                          \
                __m512bh w[NZ];                                                                                     \
                for (int z = 0; z < NZ; z++) w[z] = (__m512bh)_mm512_loadu_si512(wp + z * 32);                      \
                for (int m = 0; m < MR; m++) {                                                                      \
                    uint32_t pair;                                                                                  \
                    memcpy(&pair, x + m * ldx + 2 * kp, 4);                                                         \
                    const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);                                     \
                    for (int z = 0; z < NZ; z++) acc[m][z] = _mm512_dpbf16_ps(acc[m][z], xv, w[z]);                 \
                }                                                                                                   \
            }                                                                                                       \
            for (int m = 0; m < MR; m++)                                                                            \
                for (int z = 0; z < NZ; z++)                                                                        \
                    total[m][z] = k0 == 0 ? acc[m][z] : _mm512_add_ps(total[m][z], acc[m][z]);                     \
        }                                                                                                           \
        for (int m = 0; m < MR; m++)                                                                                \
            for (int z = 0; z < NZ; z++) {                                                                          \
                __m512 v = total[m][z];                                                                             \
                if (bias) v = _mm512_add_ps(v, widen(bias + z * 16));                                               \
                if (res) v = _mm512_add_ps(v, widen(res + m * ldr + z * 16));                                       \
                _mm256_storeu_si256((__m256i *)(y + m * ldy + z * 16), (__m256i)_mm512_cvtneps_pbh(v));             \
            }                                                                                                       \
    }

#define KERNELS(MR) KERNEL(MR, 1) KERNEL(MR, 2) KERNEL(MR, 3)
KERNELS(1) KERNELS(2) KERNELS(3) KERNELS(4) KERNELS(5) KERNELS(6) KERNELS(7) KERNELS(8)

typedef void (*kernel_t)(const uint16_t *, int64_t, const uint16_t *, int64_t, int64_t, uint16_t *, int64_t,
                         const uint16_t *, const uint16_t *, int64_t);
#define ROW(MR) {kernel_##MR##_1, kernel_##MR##_2, kernel_##MR##_3}
static const kernel_t KERNELS_BY_SHAPE[8][3] = {ROW(1), ROW(2), ROW(3), ROW(4), ROW(5), ROW(6), ROW(7), ROW(8)};

/* x (M, K) with row stride ldx; packed from hf_pack; y (M, N) with row stride ldy; res (M, N) with row stride ldr
 * (res may be y itself: each value is read before it is written). bias and res may be NULL. k_block >= 2, even. */
void hf_linear(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
               int64_t k_block, const uint16_t *bias, const uint16_t *res, int64_t ldr, uint16_t *y, int64_t ldy) {
    const uint16_t *panel = packed;
    for (int64_t n0 = 0; n0 < n; n0 += PANEL) {
        const int64_t width = n - n0 < PANEL ? n - n0 : PANEL;
        for (int64_t m0 = 0; m0 < m; m0 += 8) {
            const int mr = m - m0 < 8 ? (int)(m - m0) : 8;
            KERNELS_BY_SHAPE[mr - 1][width / 16 - 1](x + m0 * ldx, ldx, panel, k, k_block, y + m0 * ldy + n0, ldy,
                                                     bias ? bias + n0 : NULL, res ? res + m0 * ldr + n0 : NULL, ldr);
        }
        panel += k * width;
    }
}
