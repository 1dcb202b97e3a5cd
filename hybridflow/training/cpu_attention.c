/* Causal attention over packed sequences in float32, forward and backward: the trainer's attention on CPUs
 * (hybridflow/training/cpu_attention.py says why and when).
 *
 * A packed row holds sequences back to back (sequence s is tokens cu[s] .. cu[s+1]); each attends causally to
 * itself only. Queries q (N, H, D), keys and values (N, Hkv, D), any token and head strides, D contiguous; query
 * head h reads key head h / (H / Hkv). Outputs are contiguous: out and dq (N, H, D), dk and dv (N, Hkv, D),
 * lse (H, N), the natural log of each row's softmax normaliser (the backward recomputes the probabilities from it).
 *
 * For each sequence and key head the keys (and in the backward the values) are packed transposed, in chunks of 16
 * positions, so a block's scores stream them in one pass. Queries go in blocks of BR rows. A block's scores against
 * every key up to its last row are computed whole into a scratch buffer, soft-maxed exactly (the row's maximum,
 * then exp and sum: no online rescaling), then multiplied by the values. The backward follows FlashAttention-2:
 * P = exp(S - lse), dP = dO V^T, dS = P (dP - rowsum(dO O)), dQ = dS K, and dK, dV accumulated over the
 * sequence's query blocks in order. Keys after a row's own position have probability exactly 0.
 *
 * Every output is a float32 sum in a fixed order that depends neither on how the sequences are shared among
 * threads nor on the other sequences, so results are the same at any thread count. Written with GCC's vector
 * extensions, 16 float32 lanes a vector: built for AVX-512 (hybridflow/utils/native_build.py). */
#include <stdlib.h>

#include "cpu_vector.h"

#define BR 8 /* query rows of a block */

/* s[r][c V + lane] = scale sum_k a[r][k] bt[c][k][lane], r < BR, c < chunks. a: BR rows of d; bt: chunks of (d, V). */
static void block_scores(const float *a, const float *bt, int64_t d, int64_t chunks, float scale, float *s,
                         int64_t lds) {
    int64_t c = 0;
    for (; c + 2 <= chunks; c += 2) {
        const float *b0 = bt + c * d * V, *b1 = b0 + d * V;
        vf acc0[BR], acc1[BR];
        for (int r = 0; r < BR; r++) acc0[r] = acc1[r] = vsplat(0.0f);
        for (int64_t k = 0; k < d; k++) {
            const vf x0 = vload(b0 + k * V), x1 = vload(b1 + k * V);
            for (int r = 0; r < BR; r++) {
                const float ar = a[r * d + k];
                acc0[r] += ar * x0;
                acc1[r] += ar * x1;
            }
        }
        for (int r = 0; r < BR; r++) {
            vstore(s + r * lds + c * V, acc0[r] * scale);
            vstore(s + r * lds + (c + 1) * V, acc1[r] * scale);
        }
    }
    if (c < chunks) {
        const float *b0 = bt + c * d * V;
        vf acc0[BR];
        for (int r = 0; r < BR; r++) acc0[r] = vsplat(0.0f);
        for (int64_t k = 0; k < d; k++) {
            const vf x0 = vload(b0 + k * V);
            for (int r = 0; r < BR; r++) acc0[r] += a[r * d + k] * x0;
        }
        for (int r = 0; r < BR; r++) vstore(s + r * lds + c * V, acc0[r] * scale);
    }
}

/* o[r][z V ..] = row_scale[r] sum_{j < keys} p[r][j] b[j][z V ..] for rows r < 4 of p (row stride ldp) and NZ vectors
 * of b's rows (stride ldb) from column z0 V; o rows with stride ldo. */
#define ROWS_TIMES(NZ)                                                                                              \
    static void rows_times_##NZ(const float *p, int64_t ldp, const float *b, int64_t ldb, int64_t keys,            \
                                const float *row_scale, float *o, int64_t ldo) {                                    \
        vf acc[4][NZ];                                                                                              \
        for (int r = 0; r < 4; r++)                                                                                 \
            for (int z = 0; z < NZ; z++) acc[r][z] = vsplat(0.0f);                                                  \
        for (int64_t j = 0; j < keys; j++) {                                                                        \
            vf x[NZ];                                                                                               \
            for (int z = 0; z < NZ; z++) x[z] = vload(b + j * ldb + z * V);                                         \
            for (int r = 0; r < 4; r++) {                                                                           \
                const float pr = p[r * ldp + j];                                                                    \
                for (int z = 0; z < NZ; z++) acc[r][z] += pr * x[z];                                                \
            }                                                                                                       \
        }                                                                                                           \
        for (int r = 0; r < 4; r++)                                                                                 \
            for (int z = 0; z < NZ; z++) vstore(o + r * ldo + z * V, acc[r][z] * row_scale[r]);                     \
    }
ROWS_TIMES(1)
ROWS_TIMES(2)
ROWS_TIMES(3)
ROWS_TIMES(4)

/* o (BR, d) = diag(row_scale) p (BR, keys) b (keys, d); b rows with stride ldb. */
static void block_times(const float *p, int64_t ldp, const float *b, int64_t ldb, int64_t keys, int64_t d,
                        const float *row_scale, float *o, int64_t ldo) {
    for (int r0 = 0; r0 < BR; r0 += 4)
        for (int64_t z0 = 0; z0 < d; z0 += 4 * V) {
            const int64_t nz = (d - z0) / V < 4 ? (d - z0) / V : 4;
            const float *pr = p + r0 * ldp, *bz = b + z0, *sr = row_scale + r0;
            float *oz = o + r0 * ldo + z0;
            switch (nz) {
            case 1: rows_times_1(pr, ldp, bz, ldb, keys, sr, oz, ldo); break;
            case 2: rows_times_2(pr, ldp, bz, ldb, keys, sr, oz, ldo); break;
            case 3: rows_times_3(pr, ldp, bz, ldb, keys, sr, oz, ldo); break;
            default: rows_times_4(pr, ldp, bz, ldb, keys, sr, oz, ldo); break;
            }
        }
}

/* out[j][z V ..] += scale sum_{r < BR} p[r][j] b[r][z V ..] for 4 keys j0 .. j0 + 3 (or 1: FOUR = 1). */
#define KEYS_TIMES(FOUR, NZ)                                                                                        \
    static void keys_times_##FOUR##_##NZ(const float *p, int64_t ldp, int64_t j0, const float *b, int64_t ldb,    \
                                         float scale, float *out, int64_t ldo) {                                    \
        vf acc[FOUR][NZ];                                                                                           \
        for (int j = 0; j < FOUR; j++)                                                                              \
            for (int z = 0; z < NZ; z++) acc[j][z] = vsplat(0.0f);                                                  \
        for (int r = 0; r < BR; r++) {                                                                              \
            vf x[NZ];                                                                                               \
            for (int z = 0; z < NZ; z++) x[z] = vload(b + r * ldb + z * V);                                         \
            for (int j = 0; j < FOUR; j++) {                                                                        \
                const float pj = p[r * ldp + j0 + j];                                                               \
                for (int z = 0; z < NZ; z++) acc[j][z] += pj * x[z];                                                \
            }                                                                                                       \
        }                                                                                                           \
        for (int j = 0; j < FOUR; j++)                                                                              \
            for (int z = 0; z < NZ; z++) {                                                                          \
                float *dst = out + (j0 + j) * ldo + z * V;                                                          \
                vstore(dst, vload(dst) + acc[j][z] * scale);                                                        \
            }                                                                                                       \
    }
KEYS_TIMES(4, 1)
KEYS_TIMES(4, 2)
KEYS_TIMES(4, 3)
KEYS_TIMES(4, 4)
KEYS_TIMES(1, 1)
KEYS_TIMES(1, 2)
KEYS_TIMES(1, 3)
KEYS_TIMES(1, 4)

/* out (keys, d) += scale p^T (keys, BR) b (BR, d); b: BR rows of d (stride d). */
static void block_transposed_times(const float *p, int64_t ldp, const float *b, int64_t keys, int64_t d, float scale,
                                   float *out, int64_t ldo) {
    for (int64_t z0 = 0; z0 < d; z0 += 4 * V) {
        const int64_t nz = (d - z0) / V < 4 ? (d - z0) / V : 4;
        int64_t j = 0;
        for (; j + 4 <= keys; j += 4) switch (nz) {
            case 1: keys_times_4_1(p, ldp, j, b + z0, d, scale, out + z0, ldo); break;
            case 2: keys_times_4_2(p, ldp, j, b + z0, d, scale, out + z0, ldo); break;
            case 3: keys_times_4_3(p, ldp, j, b + z0, d, scale, out + z0, ldo); break;
            default: keys_times_4_4(p, ldp, j, b + z0, d, scale, out + z0, ldo); break;
            }
        for (; j < keys; j++) switch (nz) {
            case 1: keys_times_1_1(p, ldp, j, b + z0, d, scale, out + z0, ldo); break;
            case 2: keys_times_1_2(p, ldp, j, b + z0, d, scale, out + z0, ldo); break;
            case 3: keys_times_1_3(p, ldp, j, b + z0, d, scale, out + z0, ldo); break;
            default: keys_times_1_4(p, ldp, j, b + z0, d, scale, out + z0, ldo); break;
            }
    }
}

/* x's rows of one head (length rows, token stride ld), transposed into chunks of (d, V); positions past `rows` 0. */
static void pack_transposed(const float *x, int64_t ld, int64_t rows, int64_t d, float *out) {
    const int64_t chunks = (rows + V - 1) / V;
    memset(out, 0, sizeof(float) * chunks * d * V);
    for (int64_t j = 0; j < rows; j++) {
        float *dst = out + (j / V) * d * V + j % V;
        for (int64_t k = 0; k < d; k++) dst[k * V] = x[j * ld + k];
    }
}

/* BR rows of one head from row i0 (at most `rows` of them) into a (BR, d) block; the missing rows 0. */
static void load_block(const float *x, int64_t ld, int64_t i0, int64_t rows, int64_t d, float *block) {
    for (int64_t r = 0; r < BR; r++) {
        if (r < rows)
            memcpy(block + r * d, x + (i0 + r) * ld, sizeof(float) * d);
        else
            memset(block + r * d, 0, sizeof(float) * d);
    }
}

/* Row r of a block (query i0 + r) sees keys 0 .. i0 + r: the lanes after that up to `width` become -inf. */
static void mask_future(float *s, int64_t lds, int64_t i0, int64_t width) {
    for (int64_t r = 0; r < BR; r++)
        for (int64_t j = i0 + r + 1; j < width; j++) s[r * lds + j] = -INFINITY;
}

typedef struct {
    const float *q, *k, *v;
    int64_t q_token, q_head, k_token, k_head, v_token, v_head; /* strides, in floats */
    const int64_t *cu;                                         /* (sequences + 1,) */
    int64_t tokens, heads, kv_heads, d;
    float scale;
    const float *out, *dout; /* the backward's: (N, H, d) contiguous */
} Attention;

typedef struct {
    float *kt, *vt, *s, *ds, *qb, *ob, *row;
} Scratch;

static void scratch_free(Scratch *w) {
    free(w->kt), free(w->vt), free(w->s), free(w->ds), free(w->qb), free(w->ob), free(w->row);
}

/* Scratch for sequences of up to `longest` tokens; 0 (nothing kept) when memory ran out. */
static int scratch_for(Scratch *w, int64_t longest, int64_t d) {
    const int64_t padded = longest > V ? (longest + V - 1) / V * V : V;
    w->kt = malloc(sizeof(float) * padded * d);
    w->vt = malloc(sizeof(float) * padded * d);
    w->s = malloc(sizeof(float) * BR * padded);
    w->ds = malloc(sizeof(float) * BR * padded);
    w->qb = malloc(sizeof(float) * BR * d);
    w->ob = malloc(sizeof(float) * BR * d);
    w->row = malloc(sizeof(float) * BR);
    if (w->kt && w->vt && w->s && w->ds && w->qb && w->ob && w->row) return 1;
    scratch_free(w);
    return 0;
}

static int64_t longest_of(const int64_t *cu, int64_t first, int64_t last) {
    int64_t longest = 0;
    for (int64_t s = first; s < last; s++) longest = cu[s + 1] - cu[s] > longest ? cu[s + 1] - cu[s] : longest;
    return longest;
}

/* Sequences first .. last - 1: out (N, H, d) and lse (H, N). Returns 0 when scratch memory ran out, else 1. */
int hf_attention_forward(const Attention *a, int64_t first, int64_t last, float *out, float *lse) {
    const int64_t d = a->d, group = a->heads / a->kv_heads;
    Scratch w;
    if (!scratch_for(&w, longest_of(a->cu, first, last), d)) return 0;
    for (int64_t s = first; s < last; s++) {
        const int64_t start = a->cu[s], length = a->cu[s + 1] - start;
        const int64_t lds = (length + V - 1) / V * V;
        for (int64_t hk = 0; hk < a->kv_heads && length > 0; hk++) {
            const float *keys = a->k + start * a->k_token + hk * a->k_head;
            const float *values = a->v + start * a->v_token + hk * a->v_head;
            pack_transposed(keys, a->k_token, length, d, w.kt);
            for (int64_t h = hk * group; h < (hk + 1) * group; h++) {
                const float *queries = a->q + start * a->q_token + h * a->q_head;
                for (int64_t i0 = 0; i0 < length; i0 += BR) {
                    const int64_t rows = length - i0 < BR ? length - i0 : BR;
                    const int64_t seen = i0 + rows, chunks = (seen + V - 1) / V;
                    load_block(queries, a->q_token, i0, rows, d, w.qb);
                    block_scores(w.qb, w.kt, d, chunks, a->scale, w.s, lds);
                    mask_future(w.s, lds, i0, chunks * V);
                    for (int64_t r = 0; r < BR; r++) {
                        float *sr = w.s + r * lds;
                        if (r >= rows) { /* a missing row: probability 0 everywhere, so it adds nothing */
                            memset(sr, 0, sizeof(float) * chunks * V);
                            w.row[r] = 0.0f;
                            continue;
                        }
                        vf m = vsplat(-INFINITY);
                        for (int64_t c = 0; c < chunks; c++) m = vmax(m, vload(sr + c * V));
                        const float top = hmax(m);
                        vf sum = vsplat(0.0f);
                        for (int64_t c = 0; c < chunks; c++) {
                            const vf e = vexp(vload(sr + c * V) - top);
                            vstore(sr + c * V, e);
                            sum += e;
                        }
                        const float total = hsum(sum);
                        w.row[r] = 1.0f / total;
                        lse[h * a->tokens + start + i0 + r] = top + logf(total);
                    }
                    block_times(w.s, lds, values, a->v_token, seen, d, w.row, w.ob, d);
                    for (int64_t r = 0; r < rows; r++)
                        memcpy(out + ((start + i0 + r) * a->heads + h) * d, w.ob + r * d, sizeof(float) * d);
                }
            }
        }
    }
    scratch_free(&w);
    return 1;
}

/* Sequences first .. last - 1 of the backward: dq (N, H, d), dk and dv (N, Hkv, d) (their rows of these sequences
 * are overwritten), from a->out, a->dout and lse. Returns 0 when scratch memory ran out, else 1. */
int hf_attention_backward(const Attention *a, int64_t first, int64_t last, const float *lse, float *dq, float *dk,
                          float *dv) {
    const int64_t d = a->d, group = a->heads / a->kv_heads, ldk = a->kv_heads * d;
    Scratch w;
    if (!scratch_for(&w, longest_of(a->cu, first, last), d)) return 0;
    float delta[BR], unit[BR];
    for (int r = 0; r < BR; r++) unit[r] = a->scale;
    for (int64_t s = first; s < last; s++) {
        const int64_t start = a->cu[s], length = a->cu[s + 1] - start;
        const int64_t lds = (length + V - 1) / V * V;
        for (int64_t hk = 0; hk < a->kv_heads && length > 0; hk++) {
            const float *keys = a->k + start * a->k_token + hk * a->k_head;
            const float *values = a->v + start * a->v_token + hk * a->v_head;
            float *dkeys = dk + start * ldk + hk * d, *dvalues = dv + start * ldk + hk * d;
            for (int64_t j = 0; j < length; j++) {
                memset(dkeys + j * ldk, 0, sizeof(float) * d);
                memset(dvalues + j * ldk, 0, sizeof(float) * d);
            }
            pack_transposed(keys, a->k_token, length, d, w.kt);
            pack_transposed(values, a->v_token, length, d, w.vt);
            for (int64_t h = hk * group; h < (hk + 1) * group; h++) {
                const float *queries = a->q + start * a->q_token + h * a->q_head;
                const float *outs = a->out + (start * a->heads + h) * d, *douts = a->dout + (start * a->heads + h) * d;
                const int64_t ld = a->heads * d;
                for (int64_t i0 = 0; i0 < length; i0 += BR) {
                    const int64_t rows = length - i0 < BR ? length - i0 : BR;
                    const int64_t seen = i0 + rows, chunks = (seen + V - 1) / V;
                    load_block(queries, a->q_token, i0, rows, d, w.qb);
                    load_block(douts, ld, i0, rows, d, w.ob);
                    for (int64_t r = 0; r < BR; r++) { /* rowsum(dO O) */
                        vf acc = vsplat(0.0f);
                        for (int64_t k = 0; r < rows && k < d; k += V) acc += vload(w.ob + r * d + k) * vload(outs + (i0 + r) * ld + k);
                        delta[r] = hsum(acc);
                    }
                    block_scores(w.qb, w.kt, d, chunks, a->scale, w.s, lds);
                    mask_future(w.s, lds, i0, chunks * V);
                    block_scores(w.ob, w.vt, d, chunks, 1.0f, w.ds, lds);
                    for (int64_t r = 0; r < BR; r++) {
                        float *sr = w.s + r * lds, *dsr = w.ds + r * lds;
                        if (r >= rows) {
                            memset(sr, 0, sizeof(float) * chunks * V);
                            memset(dsr, 0, sizeof(float) * chunks * V);
                            continue;
                        }
                        const float norm = lse[h * a->tokens + start + i0 + r];
                        for (int64_t c = 0; c < chunks; c++) {
                            const vf p = vexp(vload(sr + c * V) - norm);
                            vstore(sr + c * V, p);
                            vstore(dsr + c * V, p * (vload(dsr + c * V) - delta[r]));
                        }
                    }
                    block_transposed_times(w.s, lds, w.ob, seen, d, 1.0f, dvalues, ldk);
                    block_transposed_times(w.ds, lds, w.qb, seen, d, a->scale, dkeys, ldk);
                    block_times(w.ds, lds, keys, a->k_token, seen, d, unit, w.ob, d);
                    for (int64_t r = 0; r < rows; r++)
                        memcpy(dq + ((start + i0 + r) * a->heads + h) * d, w.ob + r * d, sizeof(float) * d);
                }
            }
        }
    }
    scratch_free(&w);
    return 1;
}
