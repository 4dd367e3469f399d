// Membership (docs/protocol.md, "Members"): a rank's address is configured (table `members`)
// or learned from its first valid packet of the job's epoch (registers in state.p4); a packet
// claiming the rank from any other address is not the member's.
#ifndef NCINA_MEMBERS_P4
#define NCINA_MEMBERS_P4

control Members(in headers_t hdr, in meta_t meta, out bool is_member, out bool same_host) {
    ip4_t want_ip = 0;
    bit<16> want_port = 0;

    action expect(ip4_t ip, bit<16> port) {
        want_ip = ip;
        want_port = port;
    }

    table members {
        key = {
            meta.job_index: exact;
            hdr.nc.rank: exact;
        }
        actions = { expect; NoAction; }
        default_action = NoAction();
        size = NCINA_JOBS * NCINA_MAX_WORKERS;
    }

    apply {
        is_member = true;
        same_host = true;  // the rank's known address, if any, has the sender's IPv4 address
        if (!members.apply().hit) {
            bit<1> known;
            bit<32> epoch;
            member_known.read(known, meta.member);
            member_epoch.read(epoch, meta.member);
            if (known == 1 && epoch == meta.epoch) {
                member_ip.read(want_ip, meta.member);
                member_port.read(want_port, meta.member);
            } else {
                return;
            }
        }
        if (hdr.ipv4.src != want_ip || hdr.udp.src_port != want_port) {
            is_member = false;
        }
        if (hdr.ipv4.src != want_ip) {
            same_host = false;
        }
    }
}

#endif
