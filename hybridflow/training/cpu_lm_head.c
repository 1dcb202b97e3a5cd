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

#include "cpu_vector.h"

/* Lanes j0 .. j0 + 15 of a row (bf16 or float32) as float32 divided by the temperature; past `width`, `fill`
 * (set after the division, so that it stays what it is). */
static inline vf logits_at(const void *row, int bf16, int64_t j0, int64_t width, float temperature, float fill) {
    vf z = load_lanes(row, bf16, j0, width);
    if (temperature != 1.0f) z = z / temperature;
    for (int64_t i = width - j0; i < V; i++) z[i] = fill;
    return z;
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
            store_lanes(out, bf16, j, width, temperature != 1.0f ? d / temperature : d);
        }
    }
}
