/* NC8 codec (docs/protocol.md, "The NC8 code"): the C fast path of ncina.proto.nc8.
 *
 * Plain prototypes only: ncina/proto/nc8.py hands the lines of this file that are not
 * preprocessor directives to cffi as its cdef, and the DPDK data plane includes it.
 * The encoder's random decisions use the counter stream splitmix64(key + (i + 1) *
 * 0x9E3779B97F4A7C15) for element i of a call, the re-compression the CRC-32 rounding word
 * key ^ lane_term(i) (docs/protocol.md, "Re-compression"), so this file and the numpy reference
 * agree bit for bit.
 */
#ifndef NCINA_NC8_H
#define NCINA_NC8_H

#include <stddef.h>
#include <stdint.h>

/* Encode n float32 into NC8 codes for the window whose code 1 is 2^e_min and whose top code is
 * span + 1. Adds the number of saturated elements to *saturated. Returns 0, or 1 when some
 * element is NaN or +-Inf (its code is then meaningless; the caller reports it). */
int nc8_encode(const float *x, uint8_t *codes, size_t n, uint64_t key, int e_min, int span,
               uint64_t *saturated);

/* Decode n codes to float32 (+-2^(e_min + c - 1), 0 for c == 0). Returns the largest exponent
 * code seen, so the caller can reject codes above 64. */
int nc8_decode(const uint8_t *codes, float *x, size_t n, int e_min);

/* out[i] = +-2^(c - 1), 0 for c == 0. Codes must satisfy c <= 63 (the caller checks). */
void nc8_codes_to_int(const uint8_t *codes, int64_t *out, size_t n);

/* acc[i] += +-2^(c - 1): the aggregator's integer add. Codes must satisfy c <= 63. */
void nc8_accumulate(int64_t *acc, const uint8_t *codes, size_t n);

/* Stochastic re-compression of integer sums to codes (at most 64): element i rounds with the
 * word key ^ lane_term(i), unbiased (to 2^-32 of |S| for |S| >= 2^33; docs/protocol.md). */
void nc8_int_to_codes(const int64_t *sums, uint8_t *codes, size_t n, uint32_t key);

/* The key of an aggregator's nc8 result (docs/protocol.md, "Re-compression"): the rounding word
 * of its lane 0, the CRC-32 of the job's seed, the chunk's job, slot and offset, the slot
 * version's use (its earlier completions) and pool version (0 or 1), and the lane 0, so the
 * result does not depend on the order in which packets or slots complete. */
uint32_t nc8_result_key(uint64_t seed, uint16_t job, uint16_t slot, unsigned version,
                        uint32_t offset, uint32_t use);

#endif
