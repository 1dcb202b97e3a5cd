/* A decoder layer's elementwise work for training on CPUs, fused: RMSNorm and the SwiGLU activation, forward and
 * backward (hybridflow/training/cpu_layer_ops.py says why and when).
 *
 * RMSNorm, float32 rows of h: rstd = 1 / sqrt(mean(x^2) + eps), y = w (x rstd) (HF's two products, in that order).
 * Backward, with x^ = x rstd recomputed and g = dy w: dx = rstd (g - x^ mean(g x^)); dw = sum over rows dy x^,
 * summed per block of BLOCK_ROWS rows into partials[block], and the blocks then added in order
 * (hf_rms_norm_reduce), so that no sum depends on how rows were shared among threads.
 *
 * SwiGLU, elementwise over bf16 or float32: y = silu(a) b, in float32 and rounded once. Backward with
 * s = sigmoid(a): da = dy b s (1 + a (1 - s)), db = dy a s.
 *
 * GCC vector extensions, built for AVX-512 (hybridflow/utils/native_build.py). */
#include "cpu_vector.h"

#define BLOCK_ROWS 64

/* ------------------------------------------------------------------------------------------------ RMSNorm */

static inline float row_rstd(const float *x, int64_t h, float eps) {
    vf sum = vsplat(0.0f);
    for (int64_t i = 0; i < h; i += V) {
        const vf v = vload(x + i);
        sum += v * v;
    }
    return 1.0f / sqrtf(hsum(sum) / (float)h + eps);
}

/* Rows first .. last - 1 of x (row stride ldx): y (contiguous rows of h) and rstd. h a multiple of 16. */
void hf_rms_norm_forward(const float *x, int64_t ldx, int64_t first, int64_t last, int64_t h, const float *w,
                         float eps, float *y, float *rstd) {
    for (int64_t r = first; r < last; r++) {
        const float *xr = x + r * ldx;
        const float inv = row_rstd(xr, h, eps);
        rstd[r] = inv;
        for (int64_t i = 0; i < h; i += V) vstore(y + r * h + i, vload(w + i) * (vload(xr + i) * inv));
    }
}

/* Blocks first .. last - 1 of BLOCK_ROWS rows (the last may be short; `rows` in all): dx (contiguous rows) and
 * each block's dw partial sums, partials[block] (h floats). dy contiguous rows. */
void hf_rms_norm_backward(const float *x, int64_t ldx, const float *dy, const float *w, const float *rstd,
                          int64_t rows, int64_t h, int64_t first, int64_t last, float *dx, float *partials) {
    for (int64_t b = first; b < last; b++) {
        float *part = partials + b * h;
        memset(part, 0, sizeof(float) * h);
        const int64_t stop = (b + 1) * BLOCK_ROWS < rows ? (b + 1) * BLOCK_ROWS : rows;
        for (int64_t r = b * BLOCK_ROWS; r < stop; r++) {
            const float *xr = x + r * ldx, *dyr = dy + r * h;
            const float inv = rstd[r];
            vf dot = vsplat(0.0f);
            for (int64_t i = 0; i < h; i += V) {
                const vf xhat = vload(xr + i) * inv, d = vload(dyr + i);
                dot += d * vload(w + i) * xhat;
                vstore(part + i, vload(part + i) + d * xhat);
            }
            const float mean = hsum(dot) / (float)h;
            for (int64_t i = 0; i < h; i += V) {
                const vf xhat = vload(xr + i) * inv;
                vstore(dx + r * h + i, (vload(dyr + i) * vload(w + i) - xhat * mean) * inv);
            }
        }
    }
}

/* dw = the blocks' partial sums added in block order. */
void hf_rms_norm_reduce(const float *partials, int64_t blocks, int64_t h, float *dw) {
    memset(dw, 0, sizeof(float) * h);
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t i = 0; i < h; i += V) vstore(dw + i, vload(dw + i) + vload(partials + b * h + i));
}

/* ------------------------------------------------------------------------------------------------ SwiGLU */

static inline vf sigmoid(vf a) { return 1.0f / (1.0f + vexp(-a)); }

/* Elements first .. last - 1 (first a multiple of 16; n in all). */
void hf_swiglu_forward(const void *a, const void *b, void *y, int bf16, int64_t first, int64_t last, int64_t n) {
    for (int64_t i = first; i < last; i += V) {
        const vf av = load_lanes(a, bf16, i, n), bv = load_lanes(b, bf16, i, n);
        store_lanes(y, bf16, i, last < n ? last : n, av * sigmoid(av) * bv);
    }
}

void hf_swiglu_backward(const void *a, const void *b, const void *dy, void *da, void *db, int bf16, int64_t first,
                        int64_t last, int64_t n) {
    for (int64_t i = first; i < last; i += V) {
        const vf av = load_lanes(a, bf16, i, n), bv = load_lanes(b, bf16, i, n), d = load_lanes(dy, bf16, i, n);
        const vf s = sigmoid(av);
        const int64_t end = last < n ? last : n;
        store_lanes(da, bf16, i, end, d * bv * s * (1.0f + av * (1.0f - s)));
        store_lanes(db, bf16, i, end, d * av * s);
    }
}
