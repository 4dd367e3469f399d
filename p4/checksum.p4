// IPv4 header checksum: incoming frames are not checked (the hosts' kernels are), every frame
// the aggregator rewrites gets a fresh one.
#ifndef NCINA_CHECKSUM_P4
#define NCINA_CHECKSUM_P4

control NcinaVerifyChecksum(inout headers_t hdr, inout meta_t meta) {
    apply { }
}

control NcinaComputeChecksum(inout headers_t hdr, inout meta_t meta) {
    apply {
        update_checksum(
            hdr.ipv4.isValid(),
            { hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.tos, hdr.ipv4.total_len, hdr.ipv4.id,
              hdr.ipv4.flags, hdr.ipv4.frag_offset, hdr.ipv4.ttl, hdr.ipv4.protocol,
              hdr.ipv4.src, hdr.ipv4.dst },
            hdr.ipv4.checksum,
            HashAlgorithm.csum16);
    }
}

#endif
