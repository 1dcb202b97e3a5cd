/* The LM head's softmax over a chunk of logit rows, forward statistics and gradient, one row in one or two passes
 * (hybridflow/training/cpu_lm_head.py says why and when).
 *
 * Logits z (rows, V) are bf16 or float32 (the head matmul's output in its compute dtype), with any row stride; each
 * is widened to float32 and divided by the temperature (as torch's z.float() / T). Forward, per row: the maximum m,
 * then s = sum exp(z - m) and t = sum exp(z - m) z; lse = m + log s, the mean logit under the softmax E[z] = t / s,
 * the entropy lse - E[z], the label's logprob z_y - lse, and
 * (where asked) sum p^2 = sum exp(z - m)^2 / s^2. Backward, per row, with p = exp(z - lse):
 * dz = g_lp (onehot(y) - p) - g_H p (z - E[z]), divided by the temperature, written in the logits' dtype
 * (bf16: rounded to nearest even, as torch's .to(bfloat16)). Each row's sums run in a fixed order (16 lanes, then
 * the lanes in order), so a row's results depend on nothing else. GCC vector extensions, built for AVX-512
 * (hybridflow/utils/native_build.py). */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define V 16

typedef float vf __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi __attribute__((vector_size(64), aligned(4)));
typedef uint32_t vu __attribute__((vector_size(64), aligned(4)));
typedef uint16_t vh __attribute__((vector_size(32), aligned(2)));

static inline vf vsplat(float x) { return (vf){0} + x; }
static inline vf vselect(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }
static inline vf vmax(vf a, vf b) { return vselect(a < b, b, a); }
static inline vf vmin(vf a, vf b) { return vselect(a > b, b, a); }
static inline float hsum(vf x) {
    float s = 0.0f;
    for (int i = 0; i < V; i++) s += x[i];
    return s;
}
static inline float hmax(vf x) {
    float m = x[0];
    for (int i = 1; i < V; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* exp for float32 lanes: Cephes' expf, as in cpu_attention.c; below -87 exactly 0. */
static inline vf vexp(vf x) {
    const vi dead = x < vsplat(-87.0f);
    x = vmin(vmax(x, vsplat(-87.0f)), vsplat(88.0f));
    const vf magic = vsplat(12582912.0f);
    const vf t = x * 1.44269504088896341f + magic;
    const vf n = t - magic;
    const vi e = (vi)t - (vi)magic;
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = vsplat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + (r + 1.0f);
    return vselect(dead, vsplat(0.0f), p * (vf)((e + 127) << 23));
}

/* Lanes j0 .. j0 + 15 of a row (bf16 or float32) as float32 divided by the temperature; past `width`, `fill`. */
static inline vf logits_at(const void *row, int bf16, int64_t j0, int64_t width, float temperature, float fill) {
    vf z;
    if (j0 + V <= width) {
        if (bf16) {
            vh h;
            memcpy(&h, (const uint16_t *)row + j0, sizeof h);
            z = (vf)(__builtin_convertvector(h, vu) << 16);
        } else {
            memcpy(&z, (const float *)row + j0, sizeof z);
        }
    } else {
        z = vsplat(0.0f);
        for (int i = 0; i < V && j0 + i < width; i++) {
            if (bf16) {
                const uint32_t bits = (uint32_t)((const uint16_t *)row)[j0 + i] << 16;
                memcpy(&z[i], &bits, 4);
            } else {
                z[i] = ((const float *)row)[j0 + i];
            }
        }
        if (temperature != 1.0f) z = z / temperature;
        for (int i = 0; i < V; i++) /* after the division, so that the fill stays what it is */
            if (j0 + i >= width) z[i] = fill;
        return z;
    }
    return temperature != 1.0f ? z / temperature : z;
}

/* Rows first .. last - 1: logprobs, lse, mean (E[z]), and where not NULL the entropy and sum_v p(v)^2
 * (= sum exp(z - m)^2 / s^2) of each. */
void hf_lm_head_forward(const void *z, int bf16, int64_t ld, int64_t first, int64_t last, int64_t width,
                        const int64_t *labels, float temperature, float *logprobs, float *lse, float *mean,
                        float *entropy, float *sum_pi_squared) {
    const int64_t size = bf16 ? 2 : 4;
    for (int64_t r = first; r < last; r++) {
        const void *row = (const char *)z + r * ld * size;
        vf m = vsplat(-INFINITY);
        for (int64_t j = 0; j < width; j += V) m = vmax(m, logits_at(row, bf16, j, width, temperature, -INFINITY));
        const float top = hmax(m);
        vf s = vsplat(0.0f), t = vsplat(0.0f), u = vsplat(0.0f);
        for (int64_t j = 0; j < width; j += V) {
            /* past the row's end: a very negative finite logit, whose exp is 0 and whose product with it is -0 */
            const vf zj = logits_at(row, bf16, j, width, temperature, -FLT_MAX);
            const vf e = vexp(zj - top);
            s += e;
            t += e * zj;
            if (sum_pi_squared) u += e * e;
        }
        const float total = hsum(s), norm = top + logf(total), expected = hsum(t) / total;
        const int64_t y = labels[r];
        const vf zy = logits_at(row, bf16, y / V * V, width, temperature, 0.0f);
        logprobs[r] = zy[y % V] - norm;
        lse[r] = norm;
        mean[r] = expected;
        if (entropy) entropy[r] = norm - expected;
        if (sum_pi_squared) sum_pi_squared[r] = hsum(u) / (total * total);
    }
}

static inline void store_row(void *row, int bf16, int64_t j0, int64_t width, vf v) {
    const int64_t n = width - j0 < V ? width - j0 : V;
    if (bf16) {
        /* round to nearest even; a NaN stays a (quiet) NaN */
        const vu bits = (vu)v;
        vu rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
        const vi nan = v != v;
        rounded = (vu)(((vi)rounded & ~nan) | (nan & 0x7FC0));
        const vh h = __builtin_convertvector(rounded, vh);
        if (n == V) /* a constant size: one vector store (a variable one calls memcpy) */
            memcpy((uint16_t *)row + j0, &h, V * 2);
        else
            memcpy((uint16_t *)row + j0, &h, n * 2);
    } else if (n == V) {
        memcpy((float *)row + j0, &v, V * 4);
    } else {
        memcpy((float *)row + j0, &v, n * 4);
    }
}

/* Rows first .. last - 1: dz (the logits' dtype, row stride ld_dz) from the logits, lse, mean, labels and the
 * gradients of the logprobs and of the entropy (grad_entropy may be NULL: no entropy term). */
void hf_lm_head_backward(const void *z, int bf16, int64_t ld, int64_t first, int64_t last, int64_t width,
                         const int64_t *labels, float temperature, const float *lse, const float *mean,
                         const float *grad_logprobs, const float *grad_entropy, void *dz, int64_t ld_dz) {
    const int64_t size = bf16 ? 2 : 4;
    for (int64_t r = first; r < last; r++) {
        const void *row = (const char *)z + r * ld * size;
        void *out = (char *)dz + r * ld_dz * size;
        const float g = grad_logprobs ? grad_logprobs[r] : 0.0f, gh = grad_entropy ? grad_entropy[r] : 0.0f;
        const float norm = lse[r], expected = mean[r];
        const int64_t y = labels[r];
        for (int64_t j = 0; j < width; j += V) {
            const vf zj = logits_at(row, bf16, j, width, temperature, -FLT_MAX);
            const vf p = vexp(zj - norm);
            vf d = -(p * g);
            if (grad_entropy) d = d - p * gh * (zj - expected);
            if (y >= j && y < j + V) d[y - j] += g;
            store_row(out, bf16, j, width, temperature != 1.0f ? d / temperature : d);
        }
    }
}
