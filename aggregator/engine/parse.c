/* Parse: the ncina header of a UDP payload and the checks that need no job, in the order of
 * ncina.proto.header.parse (docs/protocol.md). Job-level checks are in admission.c. */
#include "state.h"

int nce_parse(const uint8_t *dgram, uint32_t len, struct nce_pkt *p)
{
    p->dgram = dgram;
    p->dgram_len = len;
    if (len < NCE_HDR_LEN)
        return NCE_TRUNCATED;
    const uint8_t *h = dgram;
    p->version = h[0];
    p->flags = h[1];
    p->format = h[2];
    p->emin = (int8_t)h[3];
    p->job = (uint16_t)(h[4] << 8 | h[5]);
    p->rank = (uint16_t)(h[6] << 8 | h[7]);
    p->slot = (uint16_t)(h[8] << 8 | h[9]);
    p->count = (uint16_t)(h[10] << 8 | h[11]);
    p->offset = (uint32_t)h[12] << 24 | (uint32_t)h[13] << 16 | (uint32_t)h[14] << 8 | h[15];
    p->payload = h + NCE_HDR_LEN;
    if (p->version != NCE_VERSION)
        return NCE_BAD_VERSION;
    /* Element size of the format; a blob (server mode) is any non-empty payload. Every format
     * the protocol defines passes here: which one a job takes is admission's check. */
    uint32_t size;
    if (p->format == NCE_FMT_NC8)
        size = 1;
    else if (p->format == NCE_FMT_INT)
        size = 8;
    else if (p->format == NCE_FMT_INT32)
        size = 4;
    else if (p->format == NCE_FMT_BLOB)
        size = 0;
    else
        return NCE_BAD_FORMAT;
    if (p->count == 0)
        return NCE_BAD_COUNT;
    /* With the TAG flag the last NCE_TAG_LEN bytes are the tag, not payload. */
    const uint32_t tag = p->flags & NCE_FLAG_TAG ? NCE_TAG_LEN : 0;
    p->payload_len = len >= NCE_HDR_LEN + tag ? len - NCE_HDR_LEN - tag : 0;
    if (size == 0 ? p->payload_len == 0 : p->payload_len != (uint32_t)p->count * size)
        return NCE_BAD_LENGTH;
    return -1;
}
