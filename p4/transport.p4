// Transport: of the IPv4 packets to the aggregator's address, only the UDP datagrams a host's
// stack would deliver to its socket reach the protocol (docs/protocol.md, "Transport"). The
// rest is dropped and counted in `transport_events` (the stats document's bmv2 section), never
// in the protocol's counters: a frame from a group or zero Ethernet source (a reply would go to
// the whole segment), a wrong IPv4 header checksum, a header or total length the frame
// does not hold, a fragment (a pipeline cannot reassemble: the one case where a host answers and
// the switch does not), no UDP, a UDP length below its header or beyond the IP payload, another
// UDP port.
#ifndef NCINA_TRANSPORT_P4
#define NCINA_TRANSPORT_P4

control Transport(inout headers_t hdr, inout meta_t meta, inout standard_metadata_t sm,
                  in bool group_source) {
    apply {
        meta.datagram = 0;
        bit<16> header_bytes = ((bit<16>)hdr.ipv4.ihl) << 2;
        if (group_source || hdr.ipv4.version != 4 || hdr.ipv4.ihl < 5 || hdr.ipv4.total_len < header_bytes
                || (bit<32>)hdr.ipv4.total_len + 14 > sm.packet_length) {
            transport_events.count(EV_T_IGNORED);
        } else if (sm.checksum_error == 1) {
            transport_events.count(EV_T_BAD_CHECKSUM);
        } else if (hdr.ipv4.flags[0:0] == 1 || hdr.ipv4.frag_offset != 0) {
            transport_events.count(EV_T_FRAGMENTS);
        } else if (!hdr.udp.isValid() || hdr.udp.dst_port != meta.local_port
                || hdr.udp.len < UDP_HEADER_BYTES || hdr.udp.len > hdr.ipv4.total_len - header_bytes) {
            transport_events.count(EV_T_IGNORED);
        } else {
            meta.datagram = 1;
        }
    }
}

#endif
