// Egress: each multicast copy of a result goes to one member (the replica id is its rank),
// addressed by the control plane's entry for (job, rank): configured, or installed from the
// digest of a learned member (Tofino's egress cannot read the ingress registers p4/rewrite.p4
// reads). A flooded frame never goes back out of its ingress port.
#ifndef NCINA_TOFINO_REWRITE_P4
#define NCINA_TOFINO_REWRITE_P4

control Rewrite(inout egress_headers_t hdr, in egress_intrinsic_metadata_t eg_md,
                inout egress_intrinsic_metadata_for_deparser_t dprsr) {
    Counter<bit<32>, bit<16>>(NCINA_JOBS * NCINA_JOB_EVENTS, CounterType_t.PACKETS_AND_BYTES) job_sent;

    action address(mac_t mac, ip4_t ip, bit<16> port) {
        hdr.eth.dst = mac;
        hdr.ipv4.dst = ip;
        hdr.udp.dst_port = port;
    }

    table member_addresses {
        key = {
            hdr.bridge.job_index: exact;
            eg_md.egress_rid: exact;
        }
        actions = { address; NoAction; }
        default_action = NoAction();
        size = NCINA_JOBS * NCINA_MAX_WORKERS;
    }

    apply {
#ifdef NCINA_HARVEST
        if (hdr.bridge.send == OUT_HARVEST) {  // what the harvest pass needs, before the frame
            hdr.harvest.setValid();
            hdr.harvest.send = hdr.bridge.then;
            hdr.harvest.job_index = hdr.bridge.job_index;
            hdr.harvest.sent = hdr.bridge.sent;
            hdr.harvest.slot = hdr.bridge.slot;
            hdr.harvest.group = hdr.bridge.group;
            hdr.harvest.port = hdr.bridge.ingress_port;
#ifdef NCINA_PASSES
            hdr.harvest.verdict = hdr.bridge.verdict;
#endif
        }
#endif
        if (hdr.bridge.send == OUT_MULTICAST) {
            member_addresses.apply();
            hdr.nc.rank = eg_md.egress_rid;
            job_sent.count(hdr.bridge.sent);
        } else if (hdr.bridge.send == OUT_FLOOD && eg_md.egress_port == hdr.bridge.ingress_port) {
            dprsr.drop_ctl = 1;
        }
        hdr.bridge.setInvalid();
    }
}

#endif
