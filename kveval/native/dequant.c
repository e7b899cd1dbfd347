/* kveval's fused dequantization of packed integer codes (format 'int', per-token, per-group or per-channel
 * statistics), the lean read path's hot loop: unpack, convert, scale and offset in one pass over the output instead
 * of the six memory passes eager PyTorch makes. The same arithmetic as
 * kveval.quant.formats.integer.IntFormat.reconstruct_, in float32, one rounding per operation (built with
 * -ffp-contract=off: no fused multiply-add):
 *   mode 0, symmetric:        x = 0 + q * s            (the +0 turns a -0.0 product into +0.0, as addcmul does)
 *   mode 1, float zero point: x = q * s + m
 *   mode 2, int zero point:   x = (q - z) * s
 * where q = u - offset for the BITS-bit field u of the packed row (kveval.quant.packing's little-endian bitstream,
 * code k of a byte at bits [k * BITS, (k + 1) * BITS)) and s, m, z are the code's float32 parameters.
 *
 * Shapes (strides in elements, the last dimension contiguous): packed uint8 [B, H, T, D * BITS / 8], scale and
 * zero [B, H, ceil(T / TB), G] (zero unused in mode 0), out float32 [B, H, T, D]. Token t reads the parameters of
 * row t / TB (TB = 1 for per-token and per-group statistics; KIVI's token block for per-channel ones); its D codes
 * form G groups of D / G, each a whole number of bytes, or G = D (a parameter per channel). Returns 0, or -1 for
 * arguments it does not take (the caller then runs the eager path).
 */
#include <stdint.h>

/* rows split across ``threads`` OpenMP threads when built with -fopenmp (PyTorch's own runtime, already loaded)
 * and the output has at least PARALLEL_MIN elements; each row is computed whole by one thread either way */
#define PARALLEL_MIN 65536
#ifdef _OPENMP
#define PARALLEL _Pragma("omp parallel for collapse(3) num_threads(threads) if(threads > 1 && B * H * T * D >= PARALLEL_MIN)")
#else
#define PARALLEL (void)threads;
#endif

#define GROUP_LOOP(BITS, EXPR)                                                                                  \
    for (int64_t jb = 0; jb < nbytes; jb++) {                                                                  \
        const unsigned b = pg[jb];                                                                             \
        for (int k = 0; k < 8 / (BITS); k++) {                                                                 \
            const float q = (float)((int)((b >> (k * (BITS))) & ((1u << (BITS)) - 1u)) - offset);              \
            og[jb * (8 / (BITS)) + k] = (EXPR);                                                                \
        }                                                                                                      \
    }

#define ELEMENT_LOOP(BITS, EXPR)                                                                                \
    for (int64_t jb = 0; jb < D * (BITS) / 8; jb++) {                                                          \
        const unsigned b = p[jb];                                                                              \
        for (int k = 0; k < 8 / (BITS); k++) {                                                                 \
            const int64_t d = jb * (8 / (BITS)) + k;                                                           \
            const float q = (float)((int)((b >> (k * (BITS))) & ((1u << (BITS)) - 1u)) - offset);              \
            const float sg = s[d * ss[3]];                                                                     \
            const float zg = zr ? zr[d * zs[3]] : 0.0f;                                                        \
            (void)zg; /* mode 0 reads no zero point */                                                         \
            o[d] = (EXPR);                                                                                     \
        }                                                                                                      \
    }

/* the three modes' arithmetic (the header), one LOOP each */
#define BY_MODE(LOOP, BITS)                                                                                    \
    if (mode == 0) {                                                                                           \
        LOOP(BITS, 0.0f + q * sg)                                                                              \
    } else if (mode == 1) {                                                                                    \
        LOOP(BITS, q * sg + zg)                                                                                \
    } else {                                                                                                   \
        LOOP(BITS, (q - zg) * sg)                                                                              \
    }

#define ROWS(BITS)                                                                                             \
    static void rows_##BITS(const uint8_t *packed, const int64_t *ps, const float *scale, const int64_t *ss,  \
                            const float *zero, const int64_t *zs, float *out, const int64_t *os,               \
                            const int64_t *shape, int64_t groups, int64_t tb, int offset, int mode,           \
                            int threads) {                                                                     \
        const int64_t B = shape[0], H = shape[1], T = shape[2], D = shape[3];                                  \
        const int64_t gs = D / groups, nbytes = gs * (BITS) / 8;                                               \
        PARALLEL                                                                                               \
        for (int64_t bi = 0; bi < B; bi++)                                                                     \
            for (int64_t h = 0; h < H; h++)                                                                    \
                for (int64_t t = 0; t < T; t++) {                                                              \
                    const uint8_t *p = packed + bi * ps[0] + h * ps[1] + t * ps[2];                            \
                    const float *s = scale + bi * ss[0] + h * ss[1] + (t / tb) * ss[2];                        \
                    const float *zr = zero ? zero + bi * zs[0] + h * zs[1] + (t / tb) * zs[2] : 0;             \
                    float *o = out + bi * os[0] + h * os[1] + t * os[2];                                       \
                    if (gs == 1) {                                                                             \
                        BY_MODE(ELEMENT_LOOP, BITS)                                                            \
                        continue;                                                                              \
                    }                                                                                          \
                    for (int64_t g = 0; g < groups; g++) {                                                     \
                        const float sg = s[g * ss[3]];                                                         \
                        const float zg = zr ? zr[g * zs[3]] : 0.0f;                                            \
                        const uint8_t *pg = p + g * nbytes;                                                    \
                        float *og = o + g * gs;                                                                \
                        BY_MODE(GROUP_LOOP, BITS)                                                              \
                    }                                                                                          \
                }                                                                                              \
    }

ROWS(1)
ROWS(2)
ROWS(4)
ROWS(8)

int kveval_dequant_int(const uint8_t *packed, const int64_t *ps, const float *scale, const int64_t *ss,
                       const float *zero, const int64_t *zs, float *out, const int64_t *os, const int64_t *shape,
                       int64_t groups, int64_t tb, int bits, int offset, int mode, int threads) {
    if (groups < 1 || tb < 1 || shape[3] % groups || shape[3] * bits % 8 || mode < 0 || mode > 2)
        return -1;
    if (groups != shape[3] && (shape[3] / groups) * bits % 8)
        return -1;
    if (mode != 0 && !zero)
        return -1;
    switch (bits) {
    case 1: rows_1(packed, ps, scale, ss, zero, zs, out, os, shape, groups, tb, offset, mode, threads); return 0;
    case 2: rows_2(packed, ps, scale, ss, zero, zs, out, os, shape, groups, tb, offset, mode, threads); return 0;
    case 4: rows_4(packed, ps, scale, ss, zero, zs, out, os, shape, groups, tb, offset, mode, threads); return 0;
    case 8: rows_8(packed, ps, scale, ss, zero, zs, out, os, shape, groups, tb, offset, mode, threads); return 0;
    default: return -1;
    }
}
