// Parser and deparser: Ethernet, then ARP or IPv4 (options skipped) and, unless a fragment, UDP;
// whether a host would take the datagram is ingress's decision (transport.p4). A UDP datagram for the aggregator carries
// the ncina header and, for NC8 payloads, its `count` codes (at most NCINA_K; a larger count stops
// with StackOutOfBounds and is dropped as bad_count by the ingress checks): the generated
// LaneParser of lanes.p4: the full groups of 8 codes as groups, the last count % 8 lane by lane.
#ifndef NCINA_PARSER_P4
#define NCINA_PARSER_P4

parser NcinaParser(packet_in packet, out headers_t hdr, inout meta_t meta,
                   inout standard_metadata_t sm) {
    LaneParser() lane_parser;

    state start {
        packet.extract(hdr.eth);
        transition select(hdr.eth.ether_type) {
            ETHERTYPE_IPV4: parse_ipv4;
            ETHERTYPE_ARP: parse_arp;
            default: accept;
        }
    }

    state parse_arp {
        packet.extract(hdr.arp);
        transition accept;
    }

    state parse_ipv4 {
        packet.extract(hdr.ipv4);
        transition select(hdr.ipv4.version, hdr.ipv4.ihl) {
            (4, 5): parse_ipv4_payload;
            (4, 6 .. 15): parse_ipv4_options;
            default: accept;
        }
    }

    state parse_ipv4_options {
        packet.extract(hdr.ipv4_options, ((bit<32>)hdr.ipv4.ihl - 5) << 5);
        transition parse_ipv4_payload;
    }

    // A fragment (more fragments to come, or not the first) carries no UDP header to read.
    state parse_ipv4_payload {
        transition select(hdr.ipv4.flags[0:0], hdr.ipv4.frag_offset, hdr.ipv4.protocol) {
            (0, 0, IP_PROTO_UDP): parse_udp;
            default: accept;
        }
    }

    // Any UDP datagram may be for the aggregator (its port is a table entry, which a parser cannot
    // consult): ingress decides by address and port. A datagram that is not stays byte for byte
    // what it was (a header that does not fit stops the parser; the rest is payload).
    state parse_udp {
        packet.extract(hdr.udp);
        transition parse_ncina;
    }

    state parse_ncina {
        packet.extract(hdr.nc);
        transition select(hdr.nc.format, hdr.nc.count) {
            (FORMAT_NC8, 0): accept;
            (FORMAT_NC8, _): parse_lanes;
            (FORMAT_JOB, _): parse_descriptor;
            default: accept;
        }
    }

    // The job handshake (a short one stops with PacketTooShort: bad_length in admission).
    state parse_descriptor {
        packet.extract(hdr.desc);
        transition accept;
    }

    // The lanes: the generated LaneParser (lanes.p4), one state per group of 8 or tail lane.
    state parse_lanes {
        lane_parser.apply(packet, hdr, meta);
        transition accept;
    }
}

control NcinaDeparser(packet_out packet, in headers_t hdr) {
    apply {
        packet.emit(hdr.eth);
        packet.emit(hdr.arp);
        packet.emit(hdr.ipv4);
        packet.emit(hdr.ipv4_options);
        packet.emit(hdr.udp);
        packet.emit(hdr.nc);
        packet.emit(hdr.notice);
        packet.emit(hdr.desc);
        packet.emit(hdr.codes);
        packet.emit(hdr.lanes);
        packet.emit(hdr.wide_groups);
        packet.emit(hdr.wide);
    }
}

#endif
