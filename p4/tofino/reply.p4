// The datagrams the aggregator sends, built in place from the packet that caused them: a
// result (every member's copy, or one back to a worker that lost it), a notice, or the job
// handshake's answer (as p4/reply.p4; results are `int`: docs/tofino.md). Tofino cannot
// truncate a frame in ingress: bytes the parser left unread (a tag) stay behind the datagram,
// outside its IPv4 and UDP lengths, as Ethernet padding would.
#ifndef NCINA_TOFINO_REPLY_P4
#define NCINA_TOFINO_REPLY_P4

control Reply(inout headers_t hdr, inout meta_t meta, in ingress_intrinsic_metadata_t ig_md,
              inout ingress_intrinsic_metadata_for_tm_t tm) {
    apply {
        mac_t peer_mac = hdr.eth.src;
        ip4_t peer_ip = hdr.ipv4.src;
        bit<16> peer_port = hdr.udp.src_port;
        bit<16> payload = NOTICE_BYTES;
        bit<8> fmt = meta.result_format;
        if (meta.descriptor == 1) {  // the job's descriptor (all zeros but status: no such job)
            payload = DESCRIPTOR_BYTES;
            fmt = FORMAT_JOB;
            hdr.nc.flags = meta.local_flags;
            hdr.desc.status = meta.status;  // the rest: set by the jobs table
            if (meta.job_hit == 0) {
                meta.emin = 0;
            }
            hdr.nc.slot = 0;
            hdr.nc.offset = 0;
        } else if (meta.notice == 1) {
            hdr.nc.count = 0;
        } else {
            payload = hdr.nc.count << 3;
        }
        if (meta.descriptor == 0) {  // all but the POOL bit, from the job's entry
            hdr.nc.flags[7:3] = meta.flags[7:3];
            hdr.nc.flags[1:0] = meta.flags[1:0];
        }
        hdr.nc.format = fmt;
        hdr.nc.emin = meta.emin;
        hdr.udp.len = UDP_HEADER_BYTES + NCINA_HEADER_BYTES + payload;
        hdr.udp.checksum = 0;
        hdr.ipv4.total_len = hdr.udp.len + 20;
        hdr.ipv4.ttl = 64;
        hdr.ipv4.src = meta.local_ip;
        hdr.udp.src_port = meta.local_port;
        hdr.eth.src = meta.local_mac;
        if (meta.send == OUT_REPLY) {
            hdr.eth.dst = peer_mac;
            hdr.ipv4.dst = peer_ip;
            hdr.udp.dst_port = peer_port;
            tm.ucast_egress_port = ig_md.ingress_port;
        } else {
            tm.mcast_grp_a = (MulticastGroupId_t)meta.job_index + 1;
        }
    }
}

#endif
