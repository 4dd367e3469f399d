// Egress: each multicast copy of a result goes to one member (the replica's id is its rank),
// addressed from the member registers; a flooded frame never goes back out of its ingress port.
#ifndef NCINA_REWRITE_P4
#define NCINA_REWRITE_P4

control Rewrite(inout headers_t hdr, inout meta_t meta, inout standard_metadata_t sm) {
    apply {
        if (meta.send == OUT_MULTICAST) {
            bit<32> member = (bit<32>)meta.job_index * NCINA_MAX_WORKERS + (bit<32>)sm.egress_rid;
            member_mac.read(hdr.eth.dst, member);
            member_ip.read(hdr.ipv4.dst, member);
            member_port.read(hdr.udp.dst_port, member);
            hdr.nc.rank = sm.egress_rid;
            job_events.count(meta.events + EV_RESULTS_SENT);
        } else if (meta.send == OUT_FLOOD && sm.egress_port == sm.ingress_port) {
            mark_to_drop(sm);
        }
    }
}

#endif
