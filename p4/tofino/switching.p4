// What is not aggregation (as p4/arp.p4 and p4/forward.p4): ARP replies for the aggregator's
// address, and plain L2 switching for every other frame (known MAC: its port; else flooded
// through the flood multicast group, whose copy for the ingress port egress drops). A switched
// frame leaves byte for byte as it came: the parser takes any UDP datagram's first bytes as
// an ncina header and lanes (a parser cannot tell the aggregator's address, a table entry), and
// the dense layout's parser makes an int32 result header valid with each lane, for the decode
// tables; Forward's actions make those invalid again (config.p4's NCINA_NO_SUMS), and egress
// parses nothing of a switched frame but the bridge (its IPv4 checksum stays as it came).
#ifndef NCINA_TOFINO_SWITCHING_P4
#define NCINA_TOFINO_SWITCHING_P4

#ifdef NCINA_DENSE
#define AS_RECEIVED NCINA_NO_SUMS
#else
#define AS_RECEIVED
#endif

control Arp(inout headers_t hdr, inout meta_t meta, in ingress_intrinsic_metadata_t ig_md,
            inout ingress_intrinsic_metadata_for_tm_t tm) {
    action answer(mac_t mac) {
        // The addresses swap: the asked-for address (tpa) becomes the sender's (spa). (Written
        // as `tpa = spa; spa = tpa` it answered with the asker's own address: found by the
        // v1model twin, docs/tofino.md.)
        ip4_t asked = hdr.arp.tpa;
        hdr.arp.op = ARP_REPLY;
        hdr.arp.tha = hdr.arp.sha;
        hdr.arp.tpa = hdr.arp.spa;
        hdr.arp.sha = mac;
        hdr.arp.spa = asked;
        hdr.eth.dst = hdr.eth.src;
        hdr.eth.src = mac;
        tm.ucast_egress_port = ig_md.ingress_port;
        meta.send = OUT_FORWARD;
    }

    // A request for the aggregator's address (an entry per address, op ARP_REQUEST).
    table requests {
        key = {
            hdr.arp.tpa: exact;
            hdr.arp.op: exact;
        }
        actions = { answer; NoAction; }
        default_action = NoAction();
        size = 4;
    }

    apply {
        requests.apply();
    }
}

control Forward(inout headers_t hdr, inout meta_t meta,
                inout ingress_intrinsic_metadata_for_tm_t tm) {
    action to_port(PortId_t port) {
        tm.ucast_egress_port = port;
        meta.send = OUT_FORWARD;
        AS_RECEIVED
    }

    action flood() {
        tm.mcast_grp_a = NCINA_FLOOD_GROUP;
        meta.send = OUT_FLOOD;
        AS_RECEIVED
    }

    table l2 {
        key = { hdr.eth.dst: exact; }
        actions = { to_port; flood; }
        default_action = flood();
        size = 1024;
    }

    apply {
        l2.apply();
    }
}

#endif
