// Members learned through the control plane, as the TNA program (p4/tofino/) learns them: a
// rank with no address (`meta.unknown_rank`: admission's `ranks` missed) is reported by a digest
// of its first valid packet, and the control plane installs its entries in `ranks`, `members`
// and egress `member_addresses` (ncina.aggregator.backends.tofino.twin.learning). Until they
// are in, the twin does what the TNA program does: another address claiming the rank is
// accepted (and reported too), and the copies of a result for the rank go out unaddressed.
// docs/tofino.md, "How the twin learns members".
#ifndef NCINA_TWIN_MEMBERS_P4
#define NCINA_TWIN_MEMBERS_P4

const bit<32> MEMBER_DIGEST = 1;  // v1model's receiver argument (P4Runtime names the digest)

control Learn(in headers_t hdr, in meta_t meta) {
    // The ranks whose copies egress addresses (`member_addresses` has their entry; ingress
    // cannot read an egress table): installed with it. A configured member (`ranks` and
    // `members` from the job) has none until its first valid packet's digest gives its MAC
    // address, which the job does not name: a TNA control plane would resolve it by ARP,
    // the twin's takes it from the digest. An unknown rank has none either, so the digest
    // condition is the TNA program's plus this one.
    table addressed {
        key = {
            hdr.nc.job: exact;
            hdr.nc.rank: exact;
        }
        actions = { NoAction; }
        default_action = NoAction();
        size = NCINA_JOBS * NCINA_MAX_WORKERS;
    }

    apply {
        // A copy, taken here: Reply then rewrites the source addresses of a packet that is
        // answered (the one that completes a slot), and the digest must carry the rank's.
        member_digest_t member = {hdr.nc.job, hdr.nc.rank, hdr.eth.src, hdr.ipv4.src,
                                  hdr.udp.src_port};
        if (!addressed.apply().hit || meta.unknown_rank == 1) {
            digest<member_digest_t>(MEMBER_DIGEST, member);
        }
    }
}

#endif
