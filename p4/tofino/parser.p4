// Parsers and deparsers. Ingress: Ethernet, then ARP or IPv4 (no options, not a fragment) and
// UDP; every UDP datagram's first 16 bytes as the ncina header and, for NC8 payloads of 1 to
// NCINA_K elements, `count` lanes (a parser counter loop); a larger count parses no lanes and
// admission drops it as bad_count. Egress: the bridge header, then the headers a result's copy
// rewrites.
#ifndef NCINA_TOFINO_PARSER_P4
#define NCINA_TOFINO_PARSER_P4

parser NcinaIngressParser(packet_in pkt, out headers_t hdr, out meta_t meta,
                          out ingress_intrinsic_metadata_t ig_md) {
    state start {
        pkt.extract(ig_md);
        pkt.advance(PORT_METADATA_SIZE);
        // Metadata the pipeline reads before it may have written it.
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
#ifdef NCINA_PASSES
        meta.no_rank = 0;
        meta.not_member = 0;
#else
        meta.f_rank = 0;
        meta.f_address = 0;
        meta.f_emin = 0;
        meta.f_slot = 0;
        meta.f_count = 0;
        meta.f_generation = 0;
#endif
        meta.codes_bad = 0;
        meta.unknown_rank = 0;
#ifdef NCINA_DENSE
        meta.ours = 0;
        meta.relation = 0;  // the pairs' key: 0, the slot rules never saw the packet
#endif
#ifdef NCINA_HARVEST
        meta.then = OUT_NONE;
        transition select(ig_md.ingress_port) {
            RECIRC_PORT: parse_harvest;
            default: parse_ethernet;
        }
    }

    // A result back from the recirculation port: the first pass's frame, int32 lanes.
    state parse_harvest {
        pkt.extract(hdr.harvest);
        pkt.extract(hdr.eth);
        pkt.extract(hdr.ipv4);
        pkt.extract(hdr.udp);
        pkt.extract(hdr.nc);
#ifdef NCINA_PASSES
        transition select(hdr.harvest.verdict, hdr.nc.count) {
            (VERDICT_HARVEST, 1 .. NCINA_K): parse_sum_0;  // lanes 0-31 (32-63 stay payload)
            (VERDICT_HARVEST_SECOND, _): parse_rest_0;     // both regions' sums
            (VERDICT_SECOND_FIRST .. VERDICT_SECOND_READ, _): parse_low_lane_0;  // the second
            default: accept;                               // pass: 0-31's codes, 32-63's sums
        }
    }

    NCINA_PASS_STATES
#else
        transition select(hdr.nc.count) {
            1 .. NCINA_K: parse_sum_0;
            default: accept;
        }
    }
#endif

    NCINA_SUM_STATES

    state parse_ethernet {
#endif
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
#ifdef NCINA_PASSES
        transition select(hdr.nc.count) {
            1 .. NCINA_REGION: parse_lane_0;
            default: parse_block;  // lanes 0-31 as one block, 32-63 one by one
        }
#else
        transition parse_lane_0;
#endif
    }

    NCINA_LANE_STATES
}

control NcinaIngressDeparser(packet_out pkt, inout headers_t hdr, in meta_t meta,
                             in ingress_intrinsic_metadata_for_deparser_t dprsr) {
    Digest<member_digest_t>() learned;

    apply {
        if (dprsr.digest_type == DIGEST_MEMBER) {
#ifdef NCINA_PASSES
            learned.pack({hdr.nc.job, hdr.nc.rank, meta.local_mac, meta.local_ip,
                          meta.local_port});
#else
            learned.pack({hdr.nc.job, hdr.nc.rank, meta.learned_mac, meta.learned_ip,
                          meta.learned_port});
#endif
        }
        pkt.emit(hdr.bridge);
        pkt.emit(hdr.eth);
        pkt.emit(hdr.arp);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.nc);
        pkt.emit(hdr.notice);
        pkt.emit(hdr.desc);
        NCINA_EMIT_LANES
#ifdef NCINA_DENSE
        NCINA_EMIT_SUMS
#else
        pkt.emit(hdr.wide);
#endif
    }
}

parser NcinaEgressParser(packet_in pkt, out egress_headers_t hdr, out egress_meta_t meta,
                         out egress_intrinsic_metadata_t eg_md) {
    state start {
        pkt.extract(eg_md);
        pkt.extract(hdr.bridge);
#ifdef NCINA_DENSE
        transition select(hdr.bridge.send) {
            OUT_HARVEST: accept;  // the frame goes round as it is
            OUT_MULTICAST: parse_result;
            OUT_REPLY: parse_frame;
            default: accept;  // switched at L2 (or ARP's answer): it leaves as it came
        }
#else
        transition select(hdr.bridge.send, hdr.bridge.wide) {
            (OUT_MULTICAST, _): parse_result;
            (_, 1): parse_result;
            (OUT_REPLY, _): parse_frame;
            default: accept;  // switched at L2 (or ARP's answer): it leaves as it came
        }
#endif
    }

    // A result ingress built: Ethernet, IPv4, UDP and the ncina header, all present.
    state parse_result {
        pkt.extract(hdr.eth);
        pkt.extract(hdr.ipv4);
        pkt.extract(hdr.udp);
        pkt.extract(hdr.nc);
#ifdef NCINA_DENSE
        transition accept;  // the int32 lanes stay payload
    }
#else
        transition select(hdr.bridge.wide, hdr.nc.count) {
            (1, 1 .. NCINA_K): parse_wide_0;
            default: accept;
        }
    }

    NCINA_WIDE_STATES
#endif

    // Any other datagram the aggregator sends (a notice, a handshake's answer): its IPv4
    // header, for the checksum. A frame switched at L2 is not parsed: its checksum, right or
    // wrong, leaves as it came.
    state parse_frame {
        pkt.extract(hdr.eth);
        transition select(hdr.eth.ether_type) {
            ETHERTYPE_IPV4: parse_ipv4;
            default: accept;
        }
    }

    state parse_ipv4 {
        pkt.extract(hdr.ipv4);
        transition accept;
    }
}

// Every datagram the aggregator sends gets a fresh IPv4 header checksum (as p4/checksum.p4);
// a switched frame's IPv4 header is not parsed in egress (it leaves as it came).
control NcinaEgressDeparser(packet_out pkt, inout egress_headers_t hdr, in egress_meta_t meta,
                            in egress_intrinsic_metadata_for_deparser_t dprsr) {
    Checksum() ipv4_checksum;

    apply {
        if (hdr.ipv4.isValid()) {
            hdr.ipv4.checksum = ipv4_checksum.update({
                hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.tos, hdr.ipv4.total_len, hdr.ipv4.id,
                hdr.ipv4.flags, hdr.ipv4.frag_offset, hdr.ipv4.ttl, hdr.ipv4.protocol,
                hdr.ipv4.src, hdr.ipv4.dst});
        }
#ifdef NCINA_HARVEST
        pkt.emit(hdr.harvest);
#endif
        pkt.emit(hdr.eth);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.nc);
        pkt.emit(hdr.notice);
#ifdef NCINA_NC8_RESULTS
        pkt.emit(hdr.lanes);
#endif
#ifndef NCINA_DENSE
        pkt.emit(hdr.wide);
#endif
    }
}

#endif
