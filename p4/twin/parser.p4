// The TNA program's ingress parser (p4/tofino/parser.p4) for v1model: Ethernet, then ARP or
// IPv4 (no options, not a fragment) and UDP; every UDP datagram's first 16 bytes as the ncina
// header and, for NC8 payloads of 1 to NCINA_K elements, `count` lanes (the generated states);
// a larger count parses no lanes and admission drops it as bad_count. No checksum is verified
// (the TNA program verifies none); every datagram the aggregator sends gets a fresh IPv4 header
// checksum, as the TNA egress deparser writes it, and a frame switched at L2 keeps its own (the
// TNA egress parser does not parse it).
#ifndef NCINA_TWIN_PARSER_P4
#define NCINA_TWIN_PARSER_P4

parser NcinaParser(packet_in pkt, out headers_t hdr, inout meta_t meta,
                   inout standard_metadata_t sm) {
    state start {
        // Metadata the pipeline reads before it may have written it (as the TNA parser).
        meta.send = OUT_NONE;
        meta.local = 0;
        meta.local_arp = 0;
        meta.job_hit = 0;
        meta.global_event = NO_GLOBAL_EVENT;
        meta.verdict = VERDICT_DROP;
        meta.event = 0;
        meta.event2 = 0;
        meta.notice = 0;
        meta.descriptor = 0;
        meta.lane_op = LANE_NONE;
        meta.wide = 0;
        meta.emin = 0;
        meta.job_index = 0;
        meta.events = 0;
        meta.sent_index = 0;
        meta.truncated = 0;
        meta.bad_version = 0;
        meta.handshake = 0;
        meta.f_hs_len = 0;
        meta.f_hs_count = 0;
        meta.f_format = 0;
        meta.f_count0 = 0;
        meta.f_len = 0;
        meta.f_not_nc8 = 0;
        meta.f_rank = 0;
        meta.f_address = 0;
        meta.f_emin = 0;
        meta.f_slot = 0;
        meta.f_count = 0;
        meta.f_generation = 0;
        meta.codes_bad = 0;
        meta.unknown_rank = 0;
        meta.ours = 0;
        meta.relation = 0;  // the pairs' key: 0, the slot rules never saw the packet
        pkt.extract(hdr.eth);
        transition select(hdr.eth.ether_type) {
            ETHERTYPE_IPV4: parse_ipv4;
            ETHERTYPE_ARP: parse_arp;
            default: accept;
        }
    }

    state parse_arp {
        pkt.extract(hdr.arp);
        transition accept;
    }

    state parse_ipv4 {
        pkt.extract(hdr.ipv4);
        transition select(hdr.ipv4.ihl, hdr.ipv4.frag_offset, hdr.ipv4.protocol) {
            (5, 0, IP_PROTO_UDP): parse_udp;
            default: accept;
        }
    }

    state parse_udp {
        pkt.extract(hdr.udp);
        transition parse_ncina;
    }

    state parse_ncina {
        pkt.extract(hdr.nc);
        transition select(hdr.nc.format, hdr.nc.count) {
            (FORMAT_NC8, 1 .. NCINA_K): parse_lanes;
            (FORMAT_JOB, _): parse_descriptor;
            default: accept;
        }
    }

    state parse_descriptor {
        pkt.extract(hdr.desc);
        transition accept;
    }

    state parse_lanes {
        transition parse_lane_0;
    }

    NCINA_LANE_STATES
}

control NcinaVerifyChecksum(inout headers_t hdr, inout meta_t meta) {
    apply { }
}

control NcinaComputeChecksum(inout headers_t hdr, inout meta_t meta) {
    apply {
        update_checksum(
            hdr.ipv4.isValid() && (meta.send == OUT_MULTICAST || meta.send == OUT_REPLY),
            { hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.tos, hdr.ipv4.total_len, hdr.ipv4.id,
              hdr.ipv4.flags, hdr.ipv4.frag_offset, hdr.ipv4.ttl, hdr.ipv4.protocol,
              hdr.ipv4.src, hdr.ipv4.dst },
            hdr.ipv4.checksum,
            HashAlgorithm.csum16);
    }
}

control NcinaDeparser(packet_out pkt, in headers_t hdr) {
    apply {
        pkt.emit(hdr.bridge);  // invalid again once egress has read it
        pkt.emit(hdr.eth);
        pkt.emit(hdr.arp);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.nc);
        pkt.emit(hdr.notice);
        pkt.emit(hdr.desc);
        pkt.emit(hdr.lanes);
        pkt.emit(hdr.wide);
        pkt.emit(hdr.sums);  // int32 results (the dense layout's lanes: K <= 32, one stack)
    }
}

#endif
