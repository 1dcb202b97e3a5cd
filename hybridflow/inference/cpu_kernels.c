/* The native engine's bf16 matmuls on CPUs with avx512_bf16 (hybridflow/inference/cpu_kernels.py says why).
 *
 * y (M, N) = x (M, K) W^T (+ bias) (+ residual), bf16 in and out. Each output is a float32 sum over K in ascending
 * pairs of k (vdpbf16ps), restarted from zero every k_block values of k with the blocks' sums added in order, plus
 * the bias and then the residual, rounded once to bf16 (round to nearest even). That is oneDNN's order for the same
 * product on these CPUs, so the results are oneDNN's to the bit (cpu_kernels.py finds k_block by comparing with it),
 * and no output depends on M or on the other rows: the order is the same for every row count.
 *
 * Weights are packed once (hf_pack) into panels of up to 48 columns (3 vectors of 16): panel after panel, and in
 * each, k-pair after k-pair, the panel's columns' two bf16 values, so a panel streams from memory in one pass, which
 * the hardware prefetcher follows (software prefetching measured slower). A register tile is up to 8 rows x 48
 * columns: 24 accumulators of 32. */
#include <immintrin.h>
#include <math.h>
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

/* ------------------------------------------------------------------ a decode layer, fused (cpu_decode.py)
 *
 * A decoder layer of the plain Llama / Qwen2 / Mistral shape (RMSNorm, fused q/k/v with an optional bias, rotary
 * embeddings, grouped-query attention, SiLU-gated MLP, no other biases) for rows of one token each, in two calls
 * (hf_decode_qkv, then hf_decode_attend_mlp, which first writes this step's keys and values into the cache when
 * given the rows' positions; else the caller writes them between the two), in HF's order of operations and
 * roundings: RMSNorm in float32, rounded, then scaled by the weight; rotary as round(round(x cos) + x' sin);
 * scores rounded to bf16, then scaled, masked and soft-maxed in float32, the probabilities rounded to bf16; the
 * residual adds rounded once (as oneDNN's sum post-op). The float32 sums themselves run in this file's own order
 * (and exp is this file's polynomial), so results can differ from torch's in the last bit of a bf16 value.
 * Every row is computed alone: nothing depends on the other rows or on how many masked keys follow a row's. */


static inline float bf16_to_float(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline __m512 round_bf16_ps(__m512 v) { /* v rounded to bf16 and back: where torch keeps a bf16 tensor */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

static inline void store_bf16(uint16_t *p, __m512 v) { _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v)); }

static inline __m512 widen_masked(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

/* exp for float32 lanes: Cephes' expf (range reduction by ln 2 in two parts, a degree-5 polynomial), 2^n by scalef. */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-103.97f)), _mm512_set1_ps(88.72f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* out[r] = w * round(x[r] / sqrt(mean(x[r]^2) + eps)), HF's bf16 RMSNorm; h a multiple of 16. */
void hf_rms_norm(const uint16_t *x, int64_t ldx, int64_t rows, int64_t h, const uint16_t *w, float eps,
                 uint16_t *out, int64_t ldo) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * ldx;
        __m512 sum = _mm512_setzero_ps();
        for (int64_t i = 0; i < h; i += 16) {
            const __m512 v = widen(xr + i);
            sum = _mm512_fmadd_ps(v, v, sum);
        }
        const float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(sum) / (float)h + eps);
        const __m512 scale = _mm512_set1_ps(inv);
        for (int64_t i = 0; i < h; i += 16) {
            /* round(x * inv) to bf16, then times the weight, rounded again: HF's two steps */
            const __m512 normed = round_bf16_ps(_mm512_mul_ps(widen(xr + i), scale));
            store_bf16(out + r * ldo + i, _mm512_mul_ps(normed, widen(w + i)));
        }
    }
}

typedef struct {
    /* the layer's tensors (bf16 unless said) */
    const uint16_t *input_norm, *post_norm;
    const uint16_t *qkv, *qkv_bias, *o, *gate_up, *down; /* packed panels (hf_pack); qkv_bias may be NULL */
    int64_t qkv_k_block, o_k_block, gate_up_k_block, down_k_block;
} LayerParams;

typedef struct {
    int64_t rows, hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
    /* scratch, each with room for `rows` rows */
    uint16_t *normed;   /* (rows, hidden) */
    uint16_t *qkv;      /* (rows, (heads + 2 kv_heads) head_dim) */
    uint16_t *attended; /* (rows, heads head_dim) */
    uint16_t *gate_up;  /* (rows, 2 intermediate) */
    float *scores;      /* (heads / kv_heads, key_length rounded up to 16) */
    /* the keys (rows, kv, d, key_length) and values (rows, kv, key_length, d) views' strides, in elements */
    int64_t key_stride_row, key_stride_head, key_stride_dim;
    int64_t value_stride_row, value_stride_head, value_stride_pos;
    int64_t key_length;
    /* the rows' positions (rows,): where hf_decode_attend_mlp writes this step's keys and values into the cache
     * first; NULL when the caller wrote them */
    const int64_t *positions;
} StepParams;

/* normed = RMSNorm(residual); qkv = normed Wqkv^T (+ b); rotary on the q and k heads. cos/sin: (rows, head_dim) each,
 * the rows' positions' table rows, sin with its first half negated (compact._rotary_table). */
void hf_decode_qkv(const LayerParams *layer, const StepParams *step, const uint16_t *residual, const uint16_t *cos,
                   const uint16_t *sin) {
    const int64_t rows = step->rows, h = step->hidden, d = step->head_dim, half = d / 2;
    const int64_t width = (step->heads + 2 * step->kv_heads) * d;
    hf_rms_norm(residual, h, rows, h, layer->input_norm, step->eps, step->normed, h);
    hf_linear(step->normed, h, rows, h, layer->qkv, width, layer->qkv_k_block, layer->qkv_bias, NULL, 0, step->qkv,
              width);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t head = 0; head < step->heads + step->kv_heads; head++) {
            uint16_t *x = step->qkv + r * width + head * d;
            const uint16_t *c = cos + r * d, *s = sin + r * d;
            for (int64_t i = 0; i < half; i += 16) {
                const __mmask16 m = half - i >= 16 ? 0xffff : (__mmask16)((1u << (half - i)) - 1);
                const __m512 x1 = widen_masked(x + i, m), x2 = widen_masked(x + half + i, m);
                const __m512 lo = _mm512_fmadd_ps(x2, widen_masked(s + i, m), round_bf16_ps(_mm512_mul_ps(x1, widen_masked(c + i, m))));
                const __m512 hi = _mm512_fmadd_ps(x1, widen_masked(s + half + i, m),
                                                  round_bf16_ps(_mm512_mul_ps(x2, widen_masked(c + half + i, m))));
                _mm256_mask_storeu_epi16(x + i, m, (__m256i)_mm512_cvtneps_pbh(lo));
                _mm256_mask_storeu_epi16(x + half + i, m, (__m256i)_mm512_cvtneps_pbh(hi));
            }
        }
}

/* The G query heads of one row that share a KV head, over its keys: attended = softmax(round(q K) scale + mask) V,
 * HF's roundings. Each key and value vector is widened once for the G heads. */
#define MAX_GROUP 16
static void attend_group(const StepParams *step, int64_t group, const uint16_t *q, const uint16_t *keys,
                         const uint16_t *values, const float *mask, uint16_t *out) {
    const int64_t d = step->head_dim, length = step->key_length, stride = (length + 15) / 16 * 16;
    float *scores = step->scores; /* (group, stride) */
    float top[MAX_GROUP], inv[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) top[g] = -INFINITY;
    /* The keys' head_dim rows lie a cache row's capacity apart (kv_cache stores keys transposed), a stride the
     * hardware prefetchers do not follow across pages: ask for every line of this group's keys up front, so
     * their misses overlap instead of each stalling the loop below in turn (measured 2x on its time). */
    for (int64_t i = 0; i < d; i++)
        for (int64_t l = 0; l < length; l += 32) _mm_prefetch((const char *)(keys + i * step->key_stride_dim + l), _MM_HINT_T1);
    for (int64_t l = 0; l < length; l += 16) {
        const __mmask16 m = length - l >= 16 ? 0xffff : (__mmask16)((1u << (length - l)) - 1);
        __m512 acc[MAX_GROUP];
        for (int64_t g = 0; g < group; g++) acc[g] = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i++) {
            const __m512 k = widen_masked(keys + i * step->key_stride_dim + l, m);
            for (int64_t g = 0; g < group; g++) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(bf16_to_float(q[g * d + i])), k, acc[g]);
        }
        const __m512 add = _mm512_maskz_loadu_ps(m, mask + l);
        for (int64_t g = 0; g < group; g++) {
            __m512 s = _mm512_add_ps(_mm512_mul_ps(round_bf16_ps(acc[g]), _mm512_set1_ps(step->scale)), add);
            s = _mm512_mask_blend_ps(m, _mm512_set1_ps(-INFINITY), s);
            _mm512_storeu_ps(scores + g * stride + l, s);
            const float best = _mm512_reduce_max_ps(s);
            if (best > top[g]) top[g] = best;
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *row = scores + g * stride;
        __m512 total = _mm512_setzero_ps();
        for (int64_t l = 0; l < length; l += 16) {
            const __m512 s = _mm512_loadu_ps(row + l);
            const __mmask16 seen = _mm512_cmp_ps_mask(s, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
            const __m512 e = top[g] == -INFINITY ? _mm512_setzero_ps()
                                                 : _mm512_maskz_mov_ps(seen, exp_ps(_mm512_sub_ps(s, _mm512_set1_ps(top[g]))));
            _mm512_storeu_ps(row + l, e);
            total = _mm512_add_ps(total, e);
        }
        const float sum = _mm512_reduce_add_ps(total);
        inv[g] = sum > 0.0f ? 1.0f / sum : 0.0f;
        for (int64_t l = 0; l < length; l += 16) /* the probabilities, rounded to bf16 as torch keeps them */
            _mm512_storeu_ps(row + l, round_bf16_ps(_mm512_mul_ps(_mm512_loadu_ps(row + l), _mm512_set1_ps(inv[g]))));
    }
    for (int64_t z = 0; z < d / 16; z++) {
        __m512 acc[MAX_GROUP];
        for (int64_t g = 0; g < group; g++) acc[g] = _mm512_setzero_ps();
        for (int64_t l = 0; l < length; l++) {
            if (mask[l] == -INFINITY) continue; /* a masked key adds nothing, whatever its slot holds */
            const __m512 v = widen(values + l * step->value_stride_pos + z * 16);
            for (int64_t g = 0; g < group; g++) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * stride + l]), v, acc[g]);
        }
        for (int64_t g = 0; g < group; g++) store_bf16(out + g * d + z * 16, acc[g]);
    }
}

/* Attention over the cache (keys and values already hold this step's), residual += attended Wo^T (rounded once),
 * normed = RMSNorm(residual), gate_up = normed Wgu^T, gate = round(silu(gate)) * up, residual += gate Wdown^T. */
void hf_decode_attend_mlp(const LayerParams *layer, const StepParams *step, uint16_t *residual, uint16_t *keys,
                          uint16_t *values, const float *mask) {
    const int64_t rows = step->rows, h = step->hidden, d = step->head_dim, inter = step->intermediate;
    const int64_t width = (step->heads + 2 * step->kv_heads) * d, group = step->heads / step->kv_heads;
    if (step->positions)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t kv = 0; kv < step->kv_heads; kv++) {
                const uint16_t *k = step->qkv + r * width + (step->heads + kv) * d, *v = k + step->kv_heads * d;
                uint16_t *key = keys + r * step->key_stride_row + kv * step->key_stride_head + step->positions[r];
                uint16_t *value = values + r * step->value_stride_row + kv * step->value_stride_head +
                                  step->positions[r] * step->value_stride_pos;
                for (int64_t i = 0; i < d; i++) key[i * step->key_stride_dim] = k[i];
                memcpy(value, v, (size_t)d * sizeof(uint16_t));
            }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t kv = 0; kv < step->kv_heads; kv++)
            attend_group(step, group, step->qkv + r * width + kv * group * d,
                         keys + r * step->key_stride_row + kv * step->key_stride_head,
                         values + r * step->value_stride_row + kv * step->value_stride_head,
                         mask + r * step->key_length, step->attended + r * step->heads * d + kv * group * d);
    hf_linear(step->attended, step->heads * d, rows, step->heads * d, layer->o, h, layer->o_k_block, NULL, residual, h,
              residual, h);
    hf_rms_norm(residual, h, rows, h, layer->post_norm, step->eps, step->normed, h);
    hf_linear(step->normed, h, rows, h, layer->gate_up, 2 * inter, layer->gate_up_k_block, NULL, NULL, 0,
              step->gate_up, 2 * inter);
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *gate = step->gate_up + r * 2 * inter, *up = gate + inter;
        for (int64_t i = 0; i < inter; i += 16) {
            const __m512 g = widen(gate + i);
            /* silu(g) = g / (1 + exp(-g)), rounded to bf16 (F.silu), then times up, rounded (mul_) */
            const __m512 silu = round_bf16_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
            store_bf16(gate + i, _mm512_mul_ps(silu, widen(up + i)));
        }
    }
    hf_linear(step->gate_up, 2 * inter, rows, inter, layer->down, h, layer->down_k_block, NULL, residual, h, residual,
              h);
}

/* ------------------------------------------------------------------ sampling (sampling.sample_tokens' plain case)
 *
 * One token per row from bf16 logits: greedy rows the first argmax; the others by inverse CDF with the row's counter
 * uniform (sampling.counter_uniforms' hash, exactly), over exp(logits / T - max) summed in ascending order in double
 * (as torch's cumsum on a CPU); the logprob is log_softmax(logits / T) at the token. Only the exp (this file's) and
 * the normaliser's sum order differ from torch's, in the last bits. */

static inline uint32_t mix32(uint32_t x) { /* lowbias32, sampling._mix32 */
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    return x ^ (x >> 16);
}

void hf_sample(const uint16_t *logits, int64_t ld, int64_t rows, int64_t vocab, const float *temperatures,
               const uint8_t *greedy, const int64_t *keys, const int64_t *counters, float *scratch, int64_t *tokens,
               float *logprobs) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = logits + r * ld;
        const __m512 t = _mm512_set1_ps(temperatures[r]);
        __m512 most = _mm512_set1_ps(-INFINITY);
        int64_t i = 0;
        for (; i < vocab; i += 16) { /* the scaled logits and their max */
            const __mmask16 m = vocab - i >= 16 ? 0xffff : (__mmask16)((1u << (vocab - i)) - 1);
            const __m512 x = _mm512_div_ps(widen_masked(row + i, m), t);
            _mm512_mask_storeu_ps(scratch + i, m, x);
            most = _mm512_mask_max_ps(most, m, most, x);
        }
        const float peak = _mm512_reduce_max_ps(most);
        int64_t best = 0;
        while (best < vocab - 1 && !(scratch[best] == peak)) best++; /* its first index (argmax's) */
        const __m512 top = _mm512_set1_ps(peak);
        double total = 0.0;
        i = 0;
        for (; i + 16 <= vocab; i += 16) /* exp(x - peak) in place */
            _mm512_storeu_ps(scratch + vocab + i, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(scratch + i), top)));
        if (i < vocab) {
            const __mmask16 m = (__mmask16)((1u << (vocab - i)) - 1);
            _mm512_mask_storeu_ps(scratch + vocab + i, m, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scratch + i), top)));
        }
        float *cdf = scratch + vocab;
        for (i = 0; i < vocab; i++) { total += cdf[i]; cdf[i] = (float)total; }
        int64_t token = best;
        if (!greedy[r]) {
            const uint32_t low = (uint32_t)keys[2 * r], high = (uint32_t)keys[2 * r + 1];
            const uint32_t hashed = mix32(low ^ mix32(high ^ (uint32_t)counters[r]));
            const float u = ((float)(hashed >> 8) + 1.0f) / 16777216.0f;
            const float target = u * cdf[vocab - 1];
            int64_t lo = 0, hi = vocab; /* the first index whose cumulative mass reaches the target */
            while (lo < hi) {
                const int64_t mid = lo + (hi - lo) / 2;
                if (cdf[mid] < target) lo = mid + 1; else hi = mid;
            }
            token = lo < vocab ? lo : vocab - 1;
        }
        tokens[r] = token;
        logprobs[r] = scratch[token] - (peak + logf((float)total));
    }
}
