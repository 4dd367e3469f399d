// The datagrams the aggregator sends: a result (every member's copy, or one back to a worker
// that lost it), a notice or the job handshake's answer, built in place from the packet that
// caused it. Results and notices carry the job's format, window and the aggregator's
// generation (docs/protocol.md); an answer carries the job's descriptor from its table entry.
#ifndef NCINA_REPLY_P4
#define NCINA_REPLY_P4

control Reply(inout headers_t hdr, inout meta_t meta, inout standard_metadata_t sm) {
    apply {
        mac_t peer_mac = hdr.eth.src;
        ip4_t peer_ip = hdr.ipv4.src;
        bit<16> peer_port = hdr.udp.src_port;
        bit<16> payload = 0;  // a restart notice: the header alone
        bit<8> fmt = meta.result_format;
        if (meta.descriptor == 1) {  // the job's descriptor (all zeros but status: no such job)
            payload = DESCRIPTOR_BYTES;
            fmt = FORMAT_JOB;
            hdr.desc.setValid();
            hdr.desc.status = meta.status;
            hdr.desc.mode = meta.result_format;
            hdr.desc.e_max = meta.e_max;
            hdr.desc.e_min = meta.emin;
            hdr.desc.workers = (bit<16>)meta.workers;
            hdr.desc.pool = meta.pool;
            hdr.desc.k = meta.k;
            hdr.desc.keyed = 0;
            hdr.desc.reserved = 0;
            hdr.desc.compressor = 0;
            hdr.desc.rounding = NC8_ROUNDING;
            hdr.nc.tag = 0;
            hdr.nc.pool = 0;
            hdr.nc.slot = 0;
            hdr.nc.offset = 0;
            meta.generation = meta.local_generation;
        } else if (meta.notice == 1) {
            if (hdr.notice.isValid()) {
                payload = NOTICE_BYTES;
            }
            hdr.nc.count = 0;
            job_events.count(meta.events + EV_NOTICES_SENT);
        } else if (meta.result_format == FORMAT_INT) {
            payload = hdr.nc.count << 3;
        } else {
            payload = hdr.nc.count;
        }
        hdr.nc.result = 1;
        hdr.nc.retx = meta.unjoined;  // 0 but in the answer to a probe of a rank not joined
        hdr.nc.generation = meta.generation;
        hdr.nc.format = fmt;
        hdr.nc.emin = meta.emin;
        hdr.udp.len = UDP_HEADER_BYTES + NCINA_HEADER_BYTES + payload;
        hdr.udp.checksum = 0;  // optional over IPv4; every copy has other ports and addresses
        hdr.ipv4_options.setInvalid();
        hdr.ipv4.ihl = 5;
        hdr.ipv4.total_len = hdr.udp.len + 20;
        hdr.ipv4.ttl = 64;
        hdr.ipv4.src = meta.local_ip;
        hdr.udp.src_port = meta.local_port;
        hdr.eth.src = meta.local_mac;
        // Whatever the parser left unread (a blob, a tag) is not part of the reply.
        truncate((bit<32>)hdr.ipv4.total_len + 14);
        if (meta.send == OUT_REPLY) {
            hdr.eth.dst = peer_mac;
            hdr.ipv4.dst = peer_ip;
            hdr.udp.dst_port = peer_port;
            sm.egress_spec = sm.ingress_port;
        }
    }
}

#endif
