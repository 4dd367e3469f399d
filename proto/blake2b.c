/* Keyed BLAKE2b, RFC 7693: 64-bit words, 12 rounds of the G mixing function, 128-byte blocks,
 * the parameter block reduced to its first word (digest length, key length, fanout 1, depth 1). */
#include <string.h>

#include "blake2b.h"

static const uint64_t iv[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

/* Message word schedule of each round (round r uses row r mod 10). */
static const uint8_t sigma[10][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
};

static inline uint64_t rotr(uint64_t x, unsigned n)
{
    return x >> n | x << (64 - n);
}

static inline uint64_t load64(const uint8_t *p)
{
    uint64_t w;
    memcpy(&w, p, sizeof w);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    w = __builtin_bswap64(w);
#endif
    return w;
}

#define G(a, b, c, d, x, y)              \
    do {                                 \
        v[a] = v[a] + v[b] + (x);        \
        v[d] = rotr(v[d] ^ v[a], 32);    \
        v[c] = v[c] + v[d];              \
        v[b] = rotr(v[b] ^ v[c], 24);    \
        v[a] = v[a] + v[b] + (y);        \
        v[d] = rotr(v[d] ^ v[a], 16);    \
        v[c] = v[c] + v[d];              \
        v[b] = rotr(v[b] ^ v[c], 63);    \
    } while (0)

/* One round; with r a constant (the loop below is unrolled) every index is a constant, so the
 * 16 state words stay in registers. */
#define ROUND(r)                                                   \
    do {                                                           \
        const uint8_t *z = sigma[(r) % 10];                        \
        G(0, 4, 8, 12, m[z[0]], m[z[1]]);                          \
        G(1, 5, 9, 13, m[z[2]], m[z[3]]);                          \
        G(2, 6, 10, 14, m[z[4]], m[z[5]]);                         \
        G(3, 7, 11, 15, m[z[6]], m[z[7]]);                         \
        G(0, 5, 10, 15, m[z[8]], m[z[9]]);                         \
        G(1, 6, 11, 12, m[z[10]], m[z[11]]);                       \
        G(2, 7, 8, 13, m[z[12]], m[z[13]]);                        \
        G(3, 4, 9, 14, m[z[14]], m[z[15]]);                        \
    } while (0)

static void compress(struct ncd_b2b *s, int last)
{
    uint64_t v[16], m[16];
    for (int i = 0; i < 16; i++)
        m[i] = load64(s->buf + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = s->h[i];
        v[i + 8] = iv[i];
    }
    v[12] ^= s->t;
    if (last)
        v[14] = ~v[14];
    ROUND(0);
    ROUND(1);
    ROUND(2);
    ROUND(3);
    ROUND(4);
    ROUND(5);
    ROUND(6);
    ROUND(7);
    ROUND(8);
    ROUND(9);
    ROUND(10);
    ROUND(11);
    for (int i = 0; i < 8; i++)
        s->h[i] ^= v[i] ^ v[i + 8];
}

void ncd_b2b_init(struct ncd_b2b *s, uint32_t outlen, const uint8_t *key, uint32_t keylen)
{
    memcpy(s->h, iv, sizeof s->h);
    s->h[0] ^= 0x01010000ULL ^ (uint64_t)keylen << 8 ^ outlen;
    s->t = 0;
    s->fill = 0;
    s->outlen = outlen;
    if (keylen > 0) {               /* the key, zero-padded, is the first block */
        memset(s->buf, 0, sizeof s->buf);
        memcpy(s->buf, key, keylen);
        s->fill = NCD_B2B_BLOCK;
    }
}

void ncd_b2b_update(struct ncd_b2b *s, const uint8_t *data, size_t len)
{
    while (len > 0) {
        if (s->fill == NCD_B2B_BLOCK) { /* more input follows: this block is not the last */
            s->t += NCD_B2B_BLOCK;
            compress(s, 0);
            s->fill = 0;
        }
        size_t n = NCD_B2B_BLOCK - s->fill;
        n = n < len ? n : len;
        memcpy(s->buf + s->fill, data, n);
        s->fill += (uint32_t)n;
        data += n;
        len -= n;
    }
}

void ncd_b2b_final(struct ncd_b2b *s, uint8_t *out)
{
    s->t += s->fill;
    memset(s->buf + s->fill, 0, NCD_B2B_BLOCK - s->fill);
    compress(s, 1);
    for (uint32_t i = 0; i < s->outlen; i++)
        out[i] = (uint8_t)(s->h[i / 8] >> (8 * (i % 8)));
}
