// What is not aggregation (as p4/arp.p4 and p4/forward.p4): ARP replies for the aggregator's
// address, and plain L2 switching for every other frame (known MAC: its port; else flooded
// through the flood multicast group, whose copy for the ingress port egress drops).
#ifndef NCINA_TOFINO_SWITCHING_P4
#define NCINA_TOFINO_SWITCHING_P4

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
    }

    action flood() {
        tm.mcast_grp_a = NCINA_FLOOD_GROUP;
        meta.send = OUT_FLOOD;
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
