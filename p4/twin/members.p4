// Members learned at line rate: where the TNA program (p4/tofino/admission.p4) knows a rank's
// address only from the control plane's entries (`ranks`, `members`, egress
// `member_addresses`), installed from the digest of the rank's first valid packet, the twin
// writes that packet's address into registers (Learn) and reads them where the tables miss
// (Learned in admission, Rewrite in egress). It is the TNA program with a control plane that
// installs a digest before the next packet: docs/tofino.md, "The v1model twin".
#ifndef NCINA_TWIN_MEMBERS_P4
#define NCINA_TWIN_MEMBERS_P4

register<bit<1>, bit<32>>(NCINA_JOBS * NCINA_MAX_WORKERS) member_known;
register<ip4_t, bit<32>>(NCINA_JOBS * NCINA_MAX_WORKERS) member_ip;
register<bit<16>, bit<32>>(NCINA_JOBS * NCINA_MAX_WORKERS) member_port;
register<mac_t, bit<32>>(NCINA_JOBS * NCINA_MAX_WORKERS) member_mac;

// Admission's `ranks` and `members` lookups, completed by the learned addresses.
control Learned(in headers_t hdr, in meta_t meta, inout bool has_address, inout bool is_member) {
    apply {
        if (!has_address && meta.job_hit == 1 && hdr.nc.rank < NCINA_MAX_WORKERS) {
            bit<32> cell = (bit<32>)meta.job_index * NCINA_MAX_WORKERS + (bit<32>)hdr.nc.rank;
            bit<1> known;
            member_known.read(known, cell);
            if (known == 1) {
                ip4_t ip;
                bit<16> port;
                member_ip.read(ip, cell);
                member_port.read(port, cell);
                has_address = true;
                is_member = ip == hdr.ipv4.src && port == hdr.udp.src_port;
            }
        }
    }
}

// A rank's first valid packet: its address is the rank's from now on (an unconfigured rank's
// whole address; a configured one's MAC address, which egress needs and the control plane
// does not know).
control Learn(in headers_t hdr, in meta_t meta) {
    apply {
        bit<32> cell = (bit<32>)meta.job_index * NCINA_MAX_WORKERS + (bit<32>)hdr.nc.rank;
        bit<1> known;
        member_known.read(known, cell);
        if (known == 1) {
            return;
        }
        member_known.write(cell, 1);
        member_ip.write(cell, hdr.ipv4.src);
        member_port.write(cell, hdr.udp.src_port);
        member_mac.write(cell, hdr.eth.src);
    }
}

#endif
