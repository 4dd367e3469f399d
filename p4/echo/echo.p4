// The no-op forwarder of `ncina bench aggregator --backend bmv2`: what simple_switch_grpc itself
// forwards, the peer the aggregator program is measured against. Every IPv4/UDP datagram goes
// back out of its port with addresses and ports swapped (the checksums stay valid), one reply per
// packet like the aggregator; an ARP request is answered for any address with ECHO_MAC. No
// tables: nothing to install.
#include <core.p4>
#include <v1model.p4>

const bit<48> ECHO_MAC = 0x02_00_00_00_ec_40;

header ethernet_h {
    bit<48> dst;
    bit<48> src;
    bit<16> ether_type;
}

header arp_h {
    bit<48> fixed;  // hardware and protocol types and lengths
    bit<16> op;
    bit<48> sha;
    bit<32> spa;
    bit<48> tha;
    bit<32> tpa;
}

header ipv4_h {
    bit<96> fixed;  // version to checksum: unchanged
    bit<32> src;
    bit<32> dst;
}

header udp_h {
    bit<16> src_port;
    bit<16> dst_port;
    bit<32> rest;
}

struct headers_t {
    ethernet_h eth;
    arp_h arp;
    ipv4_h ipv4;
    udp_h udp;
}

struct meta_t {}

parser EchoParser(packet_in packet, out headers_t hdr, inout meta_t meta,
                  inout standard_metadata_t sm) {
    state start {
        packet.extract(hdr.eth);
        transition select(hdr.eth.ether_type) {
            0x0800: parse_ipv4;
            0x0806: parse_arp;
            default: accept;
        }
    }

    state parse_arp {
        packet.extract(hdr.arp);
        transition accept;
    }

    state parse_ipv4 {
        packet.extract(hdr.ipv4);
        transition select(hdr.ipv4.fixed[95:88], hdr.ipv4.fixed[23:16]) {  // version+ihl, protocol
            (0x45, 17): parse_udp;
            default: accept;
        }
    }

    state parse_udp {
        packet.extract(hdr.udp);
        transition accept;
    }
}

control EchoVerify(inout headers_t hdr, inout meta_t meta) {
    apply {}
}

control EchoIngress(inout headers_t hdr, inout meta_t meta, inout standard_metadata_t sm) {
    apply {
        sm.egress_spec = sm.ingress_port;
        if (hdr.udp.isValid()) {
            bit<48> mac = hdr.eth.dst;
            hdr.eth.dst = hdr.eth.src;
            hdr.eth.src = mac;
            bit<32> ip = hdr.ipv4.dst;
            hdr.ipv4.dst = hdr.ipv4.src;
            hdr.ipv4.src = ip;
            bit<16> port = hdr.udp.dst_port;
            hdr.udp.dst_port = hdr.udp.src_port;
            hdr.udp.src_port = port;
        } else if (hdr.arp.isValid() && hdr.arp.op == 1) {
            hdr.eth.dst = hdr.eth.src;
            hdr.eth.src = ECHO_MAC;
            hdr.arp.op = 2;
            hdr.arp.tha = hdr.arp.sha;
            bit<32> asked = hdr.arp.tpa;
            hdr.arp.tpa = hdr.arp.spa;
            hdr.arp.sha = ECHO_MAC;
            hdr.arp.spa = asked;
        } else {
            mark_to_drop(sm);
        }
    }
}

control EchoEgress(inout headers_t hdr, inout meta_t meta, inout standard_metadata_t sm) {
    apply {}
}

control EchoCompute(inout headers_t hdr, inout meta_t meta) {
    apply {}
}

control EchoDeparser(packet_out packet, in headers_t hdr) {
    apply {
        packet.emit(hdr.eth);
        packet.emit(hdr.arp);
        packet.emit(hdr.ipv4);
        packet.emit(hdr.udp);
    }
}

V1Switch(EchoParser(), EchoVerify(), EchoIngress(), EchoEgress(), EchoCompute(), EchoDeparser())
    main;
