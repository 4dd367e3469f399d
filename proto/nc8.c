/* NC8 codec, C fast path; the definitions are in docs/protocol.md and nc8.h.
 * Hot loops are branch-free so the compiler can pipeline (and where it can, vectorise) them. */
#include "nc8.h"

#include <string.h>

#define NC8_GAMMA 0x9E3779B97F4A7C15ULL
/* Below the window, a gap of more than this many powers rounds to zero. */
#define NC8_MAX_GAP 41

/* The encoder's 64-bit multiplies only vectorise with AVX2 (emulated) or AVX-512 (native), which
 * the portable -O3 build cannot assume: on x86-64 the compiler also emits clones for those and
 * picks one at load time from the CPU it runs on. Integer-only, so every clone gives the same
 * bytes. */
#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define NC8_CPU_CLONES __attribute__((target_clones("default", "avx2", "arch=x86-64-v4")))
#endif
#endif
#ifndef NC8_CPU_CLONES
#define NC8_CPU_CLONES
#endif

static inline uint64_t splitmix64(uint64_t z)
{
    z ^= z >> 30;
    z *= 0xBF58476D1CE4E5B9ULL;
    z ^= z >> 27;
    z *= 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return z;
}

/* The reflected CRC-32 (polynomial 0x04C11DB7: zlib's, BMv2's and Tofino's crc32), a byte at a
 * time; the table is filled once, when the library is loaded. */
static uint32_t crc32_table[256];

__attribute__((constructor)) static void crc32_fill(void)
{
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t reg = b;
        for (int bit = 0; bit < 8; bit++)
            reg = (reg >> 1) ^ (0xEDB88320u & (0u - (reg & 1)));
        crc32_table[b] = reg;
    }
}

static inline uint32_t crc32_byte(uint32_t reg, uint8_t byte)
{
    return crc32_table[(reg ^ byte) & 0xFF] ^ (reg >> 8);
}

/* The CRC's linear part (zero register, no final xor) of lane's 4 big-endian bytes: lane i's
 * rounding word is lane 0's xor this. */
static inline uint32_t lane_term(uint32_t lane)
{
    uint32_t reg = crc32_byte(0, (uint8_t)(lane >> 24));
    reg = crc32_byte(reg, (uint8_t)(lane >> 16));
    reg = crc32_byte(reg, (uint8_t)(lane >> 8));
    return crc32_byte(reg, (uint8_t)lane);
}

uint32_t nc8_result_key(uint64_t seed, uint16_t job, uint16_t slot, unsigned version,
                        uint32_t offset, uint32_t use)
{
    uint8_t bytes[25] = {0}; /* seed 8 | job 2 | slot 2 | offset 4 | use 4 | version 1 | lane 4 */
    for (int b = 0; b < 8; b++)
        bytes[b] = (uint8_t)(seed >> (56 - 8 * b));
    bytes[8] = (uint8_t)(job >> 8);
    bytes[9] = (uint8_t)job;
    bytes[10] = (uint8_t)(slot >> 8);
    bytes[11] = (uint8_t)slot;
    for (int b = 0; b < 4; b++) {
        bytes[12 + b] = (uint8_t)(offset >> (24 - 8 * b));
        bytes[16 + b] = (uint8_t)(use >> (24 - 8 * b));
    }
    bytes[20] = (uint8_t)(version & 1);
    uint32_t reg = 0xFFFFFFFFu;
    for (size_t b = 0; b < sizeof bytes; b++)
        reg = crc32_byte(reg, bytes[b]);
    return ~reg;
}

NC8_CPU_CLONES
int nc8_encode(const float *x, uint8_t *codes, size_t n, uint64_t key, int e_min, int span,
               uint64_t *saturated)
{
    const int32_t bmin = e_min + 127; /* biased exponent of 2^e_min */
    uint64_t sat = 0;
    uint32_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &x[i], sizeof u);
        const uint64_t z = splitmix64(key + (uint64_t)(i + 1) * NC8_GAMMA);
        const uint32_t E = (u >> 23) & 0xFF;
        const uint32_t m = u & 0x7FFFFF;
        bad |= E == 0xFF;
        /* Biased exponent after the unbiased rounding up (probability m / 2^23). A subnormal
         * (E == 0) becomes 2^-126 (eb == 1) or zero (eb == 0); zero stays zero. */
        const int32_t eb = (int32_t)(E + ((uint32_t)(z & 0x7FFFFF) < m));
        const int32_t d = eb - bmin; /* e - e_min */
        sat += d > span;
        const int32_t in_window = (d < span ? d : span) + 1;
        /* Below the window: keep 2^e_min iff the top g bits of z are zero, g = e_min - e. */
        const int32_t g = -d;
        const int32_t gc = g < 1 ? 1 : (g > NC8_MAX_GAP ? NC8_MAX_GAP : g);
        const int32_t keep = ((z >> (64 - gc)) == 0) & (g <= NC8_MAX_GAP) & (eb != 0);
        const uint32_t c = (uint32_t)(d < 0 ? keep : in_window);
        codes[i] = (uint8_t)(c | (c != 0 ? (u >> 24) & 0x80 : 0));
    }
    *saturated += sat;
    return bad != 0;
}

int nc8_decode(const uint8_t *codes, float *x, size_t n, int e_min)
{
    /* Code -> float32 table built from the bit pattern: exponent field e_min + c - 1 + 127.
     * Codes whose value would not be a float32 normal get 0; the caller rejects them. */
    float table[256];
    for (int b = 0; b < 256; b++) {
        const int c = b & 0x7F;
        const int field = e_min + c + 126;
        const uint32_t bits = (c != 0 && field >= 1 && field <= 254)
                                  ? ((uint32_t)(b & 0x80) << 24) | ((uint32_t)field << 23)
                                  : 0;
        memcpy(&table[b], &bits, sizeof bits);
    }
    uint8_t top = 0;
    for (size_t i = 0; i < n; i++) {
        const uint8_t b = codes[i];
        const uint8_t c = b & 0x7F;
        top = c > top ? c : top;
        x[i] = table[b];
    }
    return top;
}

/* +-2^(c - 1) as int64, 0 for c == 0; branch-free. */
static inline int64_t code_value(uint8_t b)
{
    const uint32_t c = b & 0x7F;
    const uint64_t mag = (uint64_t)(c != 0) << ((c - 1) & 63);
    const uint64_t neg = -(uint64_t)(b >> 7); /* all ones when the sign bit is set */
    return (int64_t)((mag ^ neg) - neg);
}

/* code_value of every byte, filled on first use (an idempotent fill: threads that race on it
 * write the same values). */
static int64_t value_table[256];
static int value_table_ready;

static const int64_t *values(void)
{
    if (!__atomic_load_n(&value_table_ready, __ATOMIC_ACQUIRE)) {
        for (int b = 0; b < 256; b++)
            value_table[b] = code_value((uint8_t)b);
        __atomic_store_n(&value_table_ready, 1, __ATOMIC_RELEASE);
    }
    return value_table;
}

void nc8_codes_to_int(const uint8_t *codes, int64_t *out, size_t n)
{
    const int64_t *v = values();
    for (size_t i = 0; i < n; i++)
        out[i] = v[codes[i]];
}

void nc8_accumulate(int64_t *acc, const uint8_t *codes, size_t n)
{
    const int64_t *v = values();
    for (size_t i = 0; i < n; i++)
        acc[i] = (int64_t)((uint64_t)acc[i] + (uint64_t)v[codes[i]]);
}

/* Branch-free, and with no shift of a constant by a variable amount (which gcc 12 cannot
 * vectorise): |S| - 2^h is |S| under the mask of the bits below its top one, smeared down. With
 * the CPU clones the loop runs in AVX-512 (vplzcntq, vpsrlvq). The lanes' words go by blocks of
 * 256: lane_term is linear, so lane i's is its block's xor the CRC table's entry of i's last
 * byte, i - start, a contiguous load (0.8 ns an element, SplitMix64's word 0.9 to 1.3). */
NC8_CPU_CLONES
void nc8_int_to_codes(const int64_t *sums, uint8_t *codes, size_t n, uint32_t key)
{
    for (size_t start = 0; start < n; start += 256) {
        const uint32_t block = key ^ lane_term((uint32_t)start); /* start's last byte is 0 */
        const size_t end = n - start < 256 ? n : start + 256;
        for (size_t i = start; i < end; i++) {
            const uint64_t v = (uint64_t)sums[i];
            const uint64_t neg = v >> 63;
            const uint64_t mag = (v ^ (0 - neg)) + neg; /* |S|, 2^63 for INT64_MIN */
            const uint64_t h = (uint64_t)(63 - __builtin_clzll(mag | 1)); /* floor(log2 |S|) */
            uint64_t ones = mag | 1; /* every bit from the top one of |S| down */
            ones |= ones >> 1;
            ones |= ones >> 2;
            ones |= ones >> 4;
            ones |= ones >> 8;
            ones |= ones >> 16;
            ones |= ones >> 32;
            const uint64_t z = (uint64_t)(block ^ crc32_table[i - start]) << 32; /* the word */
            const uint64_t r = (z >> 1) >> (63 - h); /* top h bits of z = word << 32 */
            const uint64_t c = (h + 1) + (r < (mag & (ones >> 1))); /* up w.p. (|S|-2^h)/2^h */
            codes[i] = (uint8_t)((c | neg << 7) & (0 - (uint64_t)(mag != 0)));
        }
    }
}
