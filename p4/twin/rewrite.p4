// Egress (p4/tofino/rewrite.p4): each multicast copy of a result goes to one member (the
// replica id is its rank), addressed by the control plane's entry for (job, rank) (configured,
// or installed from a digest: members.p4), else unaddressed (lost, as on Tofino: the rank's
// retransmission gets the result back); a flooded frame never goes back out of its ingress
// port. The bridge header ingress wrote is read here and removed, as in the TNA program.
#ifndef NCINA_TWIN_REWRITE_P4
#define NCINA_TWIN_REWRITE_P4

control Rewrite(inout headers_t hdr, inout standard_metadata_t eg_md) {
    counter<bit<32>>(NCINA_JOBS * NCINA_JOB_EVENTS, CounterType.packets_and_bytes) job_sent;

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
        if (hdr.bridge.send == OUT_MULTICAST) {
            member_addresses.apply();
            hdr.nc.rank = eg_md.egress_rid;
            job_sent.count((bit<32>)hdr.bridge.sent);
        } else if (hdr.bridge.send == OUT_FLOOD && eg_md.egress_port == hdr.bridge.ingress_port) {
            mark_to_drop(eg_md);
        }
        hdr.bridge.setInvalid();
    }
}

#endif
