/* kveval's fused quantization of rows into packed integer codes (format 'int', dynamic per-token or per-group
 * statistics), the real cache's store of new tokens: statistics, scales rounded to their storage dtype, codes,
 * packing and the read-back values in one pass over each row, instead of the two dozen small tensor operations
 * eager PyTorch makes per call (a decode step's fixed cost at batch 1). The same arithmetic as
 * kveval.quant.formats.integer.IntFormat (range_qparams, round_codes, reconstruct_) and
 * kveval.quant.formats.base.store, in float32, one rounding per operation (built with -ffp-contract=off):
 *
 *   per group of G elements: mn, mx (any non-finite element: the call answers 1, nothing else is meaningful);
 *   clip ratio r (use_clip): mx *= r, mn *= r (absmax *= r for symmetric);
 *   mode 0, symmetric:        s = store(max(-mn, mx) / top);                 q = clamp(rint(x / s'), lo, hi);  x^ = 0 + q * s
 *   mode 1, float zero point: s = store((mx - mn) / top), m = store(mn);     q = clamp(rint((x - m) / s'), 0, top);  x^ = q * s + m
 *   mode 2, int zero point:   mn = min(mn, 0), mx = max(mx, 0), s = store((mx - mn) / top),
 *                             z = clamp(rint(-mn / s'), 0, top) (uint8);    q = clamp(rint(x / s') + z, 0, top);  x^ = (q - z) * s
 *   where s' = s, or 1 where s is 0, and store(v) = v clamped to the scale dtype's finite range, rounded to it
 *   (round to nearest, ties to even, as PyTorch converts), -0.0 made +0.0.
 *
 * Codes are packed as kveval.quant.packing.pack does: a little-endian bitstream per row, code k at stream bits
 * [k * BITS, (k + 1) * BITS), symmetric codes offset by 2^(BITS-1) first.
 *
 * Shapes: x float32 [B, H, T, D] (strides in elements for B, H, T; D contiguous); packed uint8 [B, H, T, NB],
 * NB = ceil(D * BITS / 8), scale [B, H, T, groups] (float32, or the 16-bit patterns of float16 / bfloat16),
 * zero likewise (mode 1), uint8 (mode 2) or NULL (mode 0), decoded float32 [B, H, T, D] or NULL, all contiguous.
 * Returns 0, 1 for non-finite input, or -1 for arguments it does not take (the caller runs the eager path).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PARALLEL_MIN 65536
/* the longest row (head_dim) taken: a row's codes are held on the stack between rounding and packing */
#define CODES_MAX 4096

enum { SCALE_F32 = 0, SCALE_F16 = 1, SCALE_BF16 = 2 };

static float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static uint32_t to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float clampf(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

/* rintf in the default rounding mode (to nearest, ties to even) without a library call, so that loops vectorize:
 * below 2^23 in magnitude, adding and subtracting 1.5 * 2^23 rounds away the fraction; from 2^23 on a float is
 * an integer already. The sign of a zero result may differ from rintf's; no output of this kernel depends on it
 * (a code is an integer, and each read-back formula adds or multiplies it into a value that is +0 either way). */
static float round_even(float v) {
    const float magic = 12582912.0f;
    return fabsf(v) < 8388608.0f ? (v + magic) - magic : v;
}

/* float16 bits of a finite float32 whose magnitude is at most 65504: round to nearest, ties to even */
static uint16_t f16_bits(float f) {
    const uint32_t x = to_bits(f);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7FFFFFFFu;
    if (ax < 0x38800000u) /* below 2^-14, float16's smallest normal: a multiple of 2^-24, rounded (exact scaling) */
        return (uint16_t)(sign | (uint16_t)round_even(from_bits(ax) * 16777216.0f));
    ax += 0xFFFu + ((ax >> 13) & 1u); /* ties to even on the 13 dropped bits (a carry moves into the exponent) */
    return (uint16_t)(sign | ((ax - (112u << 23)) >> 13));
}

static float f16_value(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0) {
        const float v = (float)m * 5.9604644775390625e-8f; /* m * 2^-24, exact */
        return sign ? -v : v;
    }
    return from_bits(sign | ((e + 112u) << 23) | (m << 13));
}

/* bfloat16 bits of a finite float32: round to nearest, ties to even (as c10::BFloat16) */
static uint16_t bf16_bits(float f) {
    const uint32_t x = to_bits(f);
    return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}


/* base.store: the value kept in the scale dtype (as float32), its bits written to slot i of `out` */
static float store(float v, int sdt, void *out, int64_t i) {
    if (sdt == SCALE_F16) {
        uint16_t h = f16_bits(clampf(v, -65504.0f, 65504.0f));
        if (!(h & 0x7FFFu)) h = 0;
        ((uint16_t *)out)[i] = h;
        return f16_value(h);
    }
    if (sdt == SCALE_BF16) {
        const float top = from_bits(0x7F7F0000u); /* bfloat16's largest finite value */
        uint16_t h = bf16_bits(clampf(v, -top, top));
        if (!(h & 0x7FFFu)) h = 0;
        ((uint16_t *)out)[i] = h;
        return from_bits((uint32_t)h << 16);
    }
    const float s = clampf(v, -FLT_MAX, FLT_MAX) + 0.0f;
    ((float *)out)[i] = s;
    return s;
}

static void put_code(uint8_t *row, int64_t k, int bits, unsigned u) {
    const int64_t at = k * bits;
    const int shift = (int)(at & 7);
    row[at >> 3] |= (uint8_t)(u << shift);
    if (shift + bits > 8) row[(at >> 3) + 1] |= (uint8_t)(u >> (8 - shift));
}

/* one row of D elements in `groups` groups; 1 when it holds a non-finite value */
#define LANES 8

/* min and max of n > 0 values in LANES independent lanes (a loop the compiler vectorizes; which of +0.0 and -0.0
 * a tie keeps changes no output: every use of mn and mx makes a zero +0.0); 0 when any value is not finite */
static int group_range(const float *v, int64_t n, float *mn_out, float *mx_out) {
    float mn[LANES], mx[LANES];
    int finite[LANES];
    for (int l = 0; l < LANES; l++) {
        mn[l] = mx[l] = v[0];
        finite[l] = 1;
    }
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) {
            const float a = v[j + l];
            finite[l] &= fabsf(a) <= FLT_MAX; /* false for NaN and for an infinity */
            mn[l] = a < mn[l] ? a : mn[l];
            mx[l] = a > mx[l] ? a : mx[l];
        }
    for (; j < n; j++) {
        finite[0] &= fabsf(v[j]) <= FLT_MAX;
        mn[0] = v[j] < mn[0] ? v[j] : mn[0];
        mx[0] = v[j] > mx[0] ? v[j] : mx[0];
    }
    int ok = 1;
    float lo = mn[0], hi = mx[0];
    for (int l = 0; l < LANES; l++) {
        ok &= finite[l];
        lo = mn[l] < lo ? mn[l] : lo;
        hi = mx[l] > hi ? mx[l] : hi;
    }
    *mn_out = lo;
    *mx_out = hi;
    return ok;
}

/* codes (integer-valued floats, already offset to 0..2^BITS-1) packed as kveval.quant.packing.pack's bitstream */
static void pack_row(const float *codes, int64_t D, int bits, uint8_t *row, int64_t nbytes) {
    if (8 % bits == 0 && D * bits % 8 == 0) { /* whole codes per byte: 1, 2, 4 or 8 bits */
        const int per = 8 / bits;
        for (int64_t b = 0; b < nbytes; b++) {
            unsigned byte = 0;
            for (int k = 0; k < per; k++) byte |= (unsigned)(int)codes[b * per + k] << (k * bits);
            row[b] = (uint8_t)byte;
        }
        return;
    }
    memset(row, 0, (size_t)nbytes);
    for (int64_t k = 0; k < D; k++) put_code(row, k, bits, (unsigned)(int)codes[k]);
}

static int quantize_row(const float *x, int64_t D, int64_t groups, int bits, int mode, float clip, int use_clip,
                        int sdt, uint8_t *packed, int64_t nbytes, void *scale, void *zero, int64_t p0,
                        float *decoded, float *codes) {
    const int64_t gs = D / groups;
    const float top = mode == 0 ? (float)((1 << (bits - 1)) - 1) : (float)((1 << bits) - 1);
    const float lo = mode == 0 ? -(float)(1 << (bits - 1)) : 0.0f;
    const unsigned offset = mode == 0 ? (1u << (bits - 1)) : 0u;
    for (int64_t g = 0; g < groups; g++) {
        const float *xg = x + g * gs;
        float mn, mx;
        if (!group_range(xg, gs, &mn, &mx)) return 1;
        float s, m = 0.0f;
        if (mode == 0) {
            float absmax = -mn > mx ? -mn : mx;
            if (use_clip) absmax = absmax * clip;
            s = store(absmax / top, sdt, scale, p0 + g);
        } else {
            if (use_clip) {
                mn = mn * clip;
                mx = mx * clip;
            }
            if (mode == 1) {
                s = store((mx - mn) / top, sdt, scale, p0 + g);
                m = store(mn, sdt, zero, p0 + g);
            } else {
                mn = mn < 0.0f ? mn : 0.0f;
                mx = mx > 0.0f ? mx : 0.0f;
                s = store((mx - mn) / top, sdt, scale, p0 + g);
                const uint8_t z = (uint8_t)clampf(round_even(-mn / (s == 0.0f ? 1.0f : s)), 0.0f, top);
                ((uint8_t *)zero)[p0 + g] = z;
                m = (float)z;
            }
        }
        const float safe = s == 0.0f ? 1.0f : s;
        float *qg = codes + g * gs;
        if (mode == 0)
            for (int64_t j = 0; j < gs; j++) qg[j] = clampf(round_even(xg[j] / safe), lo, top);
        else if (mode == 1)
            for (int64_t j = 0; j < gs; j++) qg[j] = clampf(round_even((xg[j] - m) / safe), 0.0f, top);
        else
            for (int64_t j = 0; j < gs; j++) qg[j] = clampf(round_even(xg[j] / safe) + m, 0.0f, top);
        if (decoded) {
            float *dg = decoded + g * gs;
            if (mode == 0)
                for (int64_t j = 0; j < gs; j++) dg[j] = 0.0f + qg[j] * s;
            else if (mode == 1)
                for (int64_t j = 0; j < gs; j++) dg[j] = qg[j] * s + m;
            else
                for (int64_t j = 0; j < gs; j++) dg[j] = (qg[j] - m) * s;
        }
    }
    if (offset)
        for (int64_t k = 0; k < D; k++) codes[k] += (float)offset;
    pack_row(codes, D, bits, packed, nbytes);
    return 0;
}

int kveval_quant_int(const float *x, const int64_t *xs, const int64_t *shape, int64_t groups, int bits, int mode,
                     float clip, int use_clip, int sdt, uint8_t *packed, void *scale, void *zero, float *decoded,
                     int threads) {
    const int64_t B = shape[0], H = shape[1], T = shape[2], D = shape[3];
    if (bits < 1 || bits > 8 || mode < 0 || mode > 2 || (mode == 0 && bits < 2) || groups < 1 || D % groups
        || sdt < 0 || sdt > 2 || (mode != 0 && !zero) || D < 1 || D > CODES_MAX)
        return -1;
    const int64_t nbytes = (D * bits + 7) / 8, rows = B * H * T;
    int bad = 0;
#ifdef _OPENMP
#pragma omp parallel for reduction(| : bad) num_threads(threads) if (threads > 1 && rows * D >= PARALLEL_MIN)
#else
    (void)threads;
#endif
    for (int64_t r = 0; r < rows; r++) {
        const int64_t b = r / (H * T), h = (r / T) % H, t = r % T;
        float codes[CODES_MAX];
        bad |= quantize_row(x + b * xs[0] + h * xs[1] + t * xs[2], D, groups, bits, mode, clip, use_clip, sdt,
                            packed + r * nbytes, nbytes, scale, zero, r * groups, decoded ? decoded + r * D : 0,
                            codes);
    }
    return bad ? 1 : 0;
}
