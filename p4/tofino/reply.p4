// The datagrams the aggregator sends, built in place from the packet that caused them: a
// result (every member's copy, or one back to a worker that lost it), a notice, or the job
// handshake's answer (as p4/reply.p4; results are `int`: docs/tofino.md). Each is one action
// (one stage): the lengths come from the count's precomputed byte size. Tofino cannot truncate
// a frame in ingress: bytes the parser left unread (a tag) stay behind the datagram, outside
// its IPv4 and UDP lengths, as Ethernet padding would.
#ifndef NCINA_TOFINO_REPLY_P4
#define NCINA_TOFINO_REPLY_P4

control Reply(inout headers_t hdr, inout meta_t meta, in ingress_intrinsic_metadata_t ig_md,
              inout ingress_intrinsic_metadata_for_tm_t tm) {
    // The job handshake's answer: the job as the switch holds it (an entry per job); no such
    // job, all zeros.
    action answer(bit<8> mode, bit<8> e_max, bit<8> e_min, bit<16> workers, bit<16> pool,
                  bit<16> k) {
        hdr.desc.mode = mode;
        hdr.desc.e_max = e_max;
        hdr.desc.e_min = e_min;
        hdr.desc.workers = workers;
        hdr.desc.pool = pool;
        hdr.desc.k = k;
        hdr.desc.keyed = 0;
        hdr.desc.reserved = 0;
        hdr.desc.compressor = 0;
    }

    table answers {
        key = { hdr.nc.job: exact; }
        actions = { answer; }
        default_action = answer(0, 0, 0, 0, 0, 0);
        size = NCINA_JOBS;
    }

    action as_answer() {
        hdr.desc.status = meta.status;
        hdr.desc.rounding = NC8_ROUNDING;
        hdr.nc.flags = meta.local_flags;
        hdr.nc.format = FORMAT_JOB;
        hdr.nc.emin = meta.emin;
        hdr.nc.slot = 0;
        hdr.nc.offset = 0;
        hdr.udp.len = UDP_HEADER_BYTES + NCINA_HEADER_BYTES + DESCRIPTOR_BYTES;
        hdr.ipv4.total_len = 20 + UDP_HEADER_BYTES + NCINA_HEADER_BYTES + DESCRIPTOR_BYTES;
    }

    // A notice: the bitmap follows the header, except in a restart notice (`bytes` 0).
    action as_notice(bit<16> bytes) {
        hdr.nc.flags[7:3] = meta.flags[7:3];  // all but the POOL bit, from the job's entry
        hdr.nc.flags[1:0] = meta.flags[1:0];
        hdr.nc.format = meta.result_format;
        hdr.nc.emin = meta.emin;
        hdr.nc.count = 0;
        hdr.udp.len = UDP_HEADER_BYTES + NCINA_HEADER_BYTES + bytes;
        hdr.ipv4.total_len = 20 + UDP_HEADER_BYTES + NCINA_HEADER_BYTES + bytes;
    }

    action as_result() {
        hdr.nc.flags[7:3] = meta.flags[7:3];
        hdr.nc.flags[1:0] = meta.flags[1:0];
        hdr.nc.format = meta.result_format;
        hdr.nc.emin = meta.emin;
#if defined(NCINA_DENSE) || defined(NCINA_TWIN)
        hdr.udp.len = meta.result_bytes + (UDP_HEADER_BYTES + NCINA_HEADER_BYTES);
        hdr.ipv4.total_len = meta.result_bytes + (20 + UDP_HEADER_BYTES + NCINA_HEADER_BYTES);
#else
        hdr.udp.len = meta.int_bytes + (UDP_HEADER_BYTES + NCINA_HEADER_BYTES);
        hdr.ipv4.total_len = meta.int_bytes + (20 + UDP_HEADER_BYTES + NCINA_HEADER_BYTES);
#endif
    }

    // From the aggregator's address, back to the sender or to the job's multicast group.
    action to_sender() {
#ifdef NCINA_PASSES
        mac_t sender_mac = hdr.eth.src;  // kept in meta.local_* for the member digest
        ip4_t sender_ip = hdr.ipv4.src;
        bit<16> sender_port = hdr.udp.src_port;
#endif
        hdr.eth.dst = hdr.eth.src;
        hdr.eth.src = meta.local_mac;
        hdr.ipv4.dst = hdr.ipv4.src;
        hdr.ipv4.src = meta.local_ip;
        hdr.ipv4.ttl = 64;
        hdr.udp.dst_port = hdr.udp.src_port;
        hdr.udp.src_port = meta.local_port;
#ifdef NCINA_PASSES
        meta.local_mac = sender_mac;
        meta.local_ip = sender_ip;
        meta.local_port = sender_port;
#endif
        hdr.udp.checksum = 0;
        tm.ucast_egress_port = ig_md.ingress_port;
    }

    action to_group() {
#ifdef NCINA_PASSES
        mac_t sender_mac = hdr.eth.src;
        ip4_t sender_ip = hdr.ipv4.src;
        bit<16> sender_port = hdr.udp.src_port;
#endif
        hdr.eth.src = meta.local_mac;
        hdr.ipv4.src = meta.local_ip;
        hdr.ipv4.ttl = 64;
        hdr.udp.src_port = meta.local_port;
#ifdef NCINA_PASSES
        meta.local_mac = sender_mac;
        meta.local_ip = sender_ip;
        meta.local_port = sender_port;
#endif
        hdr.udp.checksum = 0;
        tm.mcast_grp_a = meta.group;
    }

    apply {
        if (meta.descriptor == 1) {
            answers.apply();
            as_answer();
        } else if (meta.notice == 1) {
            if (hdr.notice.isValid()) {
                as_notice(NOTICE_BYTES);
            } else {
                as_notice(0);
            }
        } else {
            as_result();
        }
        if (meta.send == OUT_REPLY) {
            to_sender();
        } else {
            to_group();
        }
    }
}

#endif
