// IPv4 header checksums: every incoming header is verified (options included), as a host does
// (transport.p4 drops and counts a wrong one); every frame the aggregator rewrites gets a fresh
// one (its replies carry no options). Frames it only switches leave as they came. UDP checksums
// are not verified: a pipeline sees the payload as parsed lanes, not as bytes to add up
// (docs/bmv2.md, "Transport").
#ifndef NCINA_CHECKSUM_P4
#define NCINA_CHECKSUM_P4

control NcinaVerifyChecksum(inout headers_t hdr, inout meta_t meta) {
    apply {
        verify_checksum(
            hdr.ipv4.isValid() && !hdr.ipv4_options.isValid(),
            { hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.tos, hdr.ipv4.total_len, hdr.ipv4.id,
              hdr.ipv4.flags, hdr.ipv4.frag_offset, hdr.ipv4.ttl, hdr.ipv4.protocol,
              hdr.ipv4.src, hdr.ipv4.dst },
            hdr.ipv4.checksum,
            HashAlgorithm.csum16);
        verify_checksum(
            hdr.ipv4_options.isValid(),
            { hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.tos, hdr.ipv4.total_len, hdr.ipv4.id,
              hdr.ipv4.flags, hdr.ipv4.frag_offset, hdr.ipv4.ttl, hdr.ipv4.protocol,
              hdr.ipv4.src, hdr.ipv4.dst, hdr.ipv4_options.data },
            hdr.ipv4.checksum,
            HashAlgorithm.csum16);
    }
}

control NcinaComputeChecksum(inout headers_t hdr, inout meta_t meta) {
    apply {
        update_checksum(
            hdr.ipv4.isValid() && meta.local == 1,
            { hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.tos, hdr.ipv4.total_len, hdr.ipv4.id,
              hdr.ipv4.flags, hdr.ipv4.frag_offset, hdr.ipv4.ttl, hdr.ipv4.protocol,
              hdr.ipv4.src, hdr.ipv4.dst },
            hdr.ipv4.checksum,
            HashAlgorithm.csum16);
    }
}

#endif
