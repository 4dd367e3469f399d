// ncina's aggregation switch for BMv2 (v1model). This file only wires the pieces together;
// config.p4 and lanes.p4 are generated for the lane count K (`make p4 K=64`).
#include <core.p4>
#include <v1model.p4>

#include "config.p4"
#include "headers.p4"
#include "state.p4"
#include "lanes.p4"
#include "parser.p4"
#include "checksum.p4"
#include "transport.p4"
#include "arp.p4"
#include "forward.p4"
#include "members.p4"
#include "admission.p4"
#include "slots.p4"
#include "reply.p4"
#include "rewrite.p4"

control NcinaIngress(inout headers_t hdr, inout meta_t meta, inout standard_metadata_t sm) {
    Arp() arp;
    Forward() forward;
    Transport() transport;
    Admission() admission;
    Slots() slots;
    Reply() reply;

    // The aggregator's own address (one entry): answered by ARP, aggregated on its UDP port.
    action aggregator(mac_t mac, bit<16> port, bit<4> generation) {
        meta.local = 1;
        meta.local_mac = mac;
        meta.local_ip = meta.target;
        meta.local_port = port;
        meta.local_generation = generation;
    }

    table local_address {
        key = { meta.target: exact; }
        actions = { aggregator; NoAction; }
        default_action = NoAction();
        size = 4;
    }

    apply {
        meta.send = OUT_NONE;
        // (An invalid header's fields keep the last packet's values on BMv2: check validity.)
        if (hdr.arp.isValid()) {
            meta.target = hdr.arp.tpa;
        } else if (hdr.ipv4.isValid()) {
            meta.target = hdr.ipv4.dst;
        }
        local_address.apply();
        // Replies go to the frame's source: one from a group (or the zero) address would go to
        // the whole segment, a reflection nobody asked for. Such a frame is not answered.
        bool group_source = hdr.eth.src[40:40] == 1 || hdr.eth.src == 0;
        if (meta.local == 1 && hdr.arp.isValid()) {
            if (hdr.arp.op == ARP_REQUEST && !group_source) {
                arp.apply(hdr, meta, sm);
            }
        } else if (meta.local == 1 && hdr.ipv4.isValid()) {
            transport.apply(hdr, meta, sm, group_source);
        }
        if (meta.datagram == 1) {
            admission.apply(hdr, meta, sm);
            if (meta.verdict == VERDICT_HANDSHAKE) {
                meta.descriptor = 1;
                meta.send = OUT_REPLY;
            } else if (meta.verdict != VERDICT_DROP) {
                slots.apply(hdr, meta, sm);
            }
            if (meta.send != OUT_NONE) {
                reply.apply(hdr, meta, sm);
            }
        } else if (meta.local == 0) {
            forward.apply(hdr, meta, sm);
        }
        if (meta.send == OUT_NONE) {
            mark_to_drop(sm);
        }
    }
}

control NcinaEgress(inout headers_t hdr, inout meta_t meta, inout standard_metadata_t sm) {
    Rewrite() rewrite;

    apply {
        rewrite.apply(hdr, meta, sm);
    }
}

V1Switch(NcinaParser(), NcinaVerifyChecksum(), NcinaIngress(), NcinaEgress(), NcinaComputeChecksum(),
         NcinaDeparser()) main;
