// Plain L2 switching for everything that is not for the aggregator (the gloo baseline between
// workers, ARP among hosts): known destination MAC -> its port, anything else flooded through
// the flood multicast group (egress drops the copy for the ingress port).
#ifndef NCINA_FORWARD_P4
#define NCINA_FORWARD_P4

control Forward(inout headers_t hdr, inout meta_t meta, inout standard_metadata_t sm) {
    action to_port(bit<9> port) {
        sm.egress_spec = port;
        meta.send = OUT_FORWARD;
    }

    action flood() {
        sm.mcast_grp = NCINA_FLOOD_GROUP;
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
