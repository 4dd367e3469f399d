/* Keyed BLAKE2b (RFC 7693) for the authentication tag of docs/protocol.md (ncina.proto.tag),
 * shared by the C data planes and the worker. Written from the RFC's description; tests check
 * it against Python's hashlib.blake2b. */
#ifndef NCD_BLAKE2B_H
#define NCD_BLAKE2B_H

#include <stddef.h>
#include <stdint.h>

#define NCD_B2B_BLOCK 128

struct ncd_b2b {
    uint64_t h[8];              /* chained state */
    uint64_t t;                 /* bytes compressed so far (the high word of the counter is 0) */
    uint32_t fill;              /* bytes in buf */
    uint32_t outlen;            /* digest bytes, 1..64 */
    uint8_t buf[NCD_B2B_BLOCK]; /* the block not yet compressed (the last one is kept back) */
};

/* Start a digest of outlen bytes, keyed with key[0..keylen) (keylen 0..64). */
void ncd_b2b_init(struct ncd_b2b *s, uint32_t outlen, const uint8_t *key, uint32_t keylen);
void ncd_b2b_update(struct ncd_b2b *s, const uint8_t *data, size_t len);
void ncd_b2b_final(struct ncd_b2b *s, uint8_t *out);

#endif
