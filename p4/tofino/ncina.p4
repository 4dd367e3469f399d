// ncina's aggregation switch for Tofino (TNA), the twin of p4/ncina.p4 (docs/tofino.md). This
// file only wires the pieces together; config.p4 and lanes.p4 are generated for the lane count
// K (`make p4-tofino K=16`).
#include <core.p4>
#include <tna.p4>

#include "config.p4"
#include "headers.p4"
#include "parser.p4"
#include "lanes.p4"
#include "switching.p4"
#include "admission.p4"
#include "slots.p4"
#include "reply.p4"
#include "events.p4"
#include "rewrite.p4"

control NcinaIngress(inout headers_t hdr, inout meta_t meta,
                     in ingress_intrinsic_metadata_t ig_md,
                     in ingress_intrinsic_metadata_from_parser_t prsr,
                     inout ingress_intrinsic_metadata_for_deparser_t dprsr,
                     inout ingress_intrinsic_metadata_for_tm_t tm) {
    Arp() arp;
    Forward() forward;
    Admission() admission;
    Slots() slots;
    Reply() reply;
    Events() events;

    // The aggregator's own address (one entry): answered by ARP, aggregated on its UDP port.
    action aggregator(mac_t mac, bit<16> port, bit<4> generation, bit<8> flags) {
        meta.local = 1;
        meta.local_mac = mac;
        meta.local_ip = meta.target;
        meta.local_port = port;
        meta.port_diff_local = hdr.udp.dst_port ^ port;
        meta.local_generation = generation;
        meta.local_flags = flags;
    }

    table local_address {
        key = { meta.target: exact; }
        actions = { aggregator; NoAction; }
        default_action = NoAction();
        size = 4;
    }

    apply {
        meta.send = OUT_NONE;
        meta.local = 0;
        meta.event = 0;
        meta.event2 = 0;
        meta.descriptor = 0;
        meta.notice = 0;
        meta.lane_op = LANE_NONE;
        if (hdr.arp.isValid()) {
            meta.target = hdr.arp.tpa;
        } else {
            meta.target = hdr.ipv4.dst;
        }
        local_address.apply();
        if (meta.local == 1 && hdr.arp.isValid()) {
            if (hdr.arp.op == ARP_REQUEST) {
                arp.apply(hdr, meta, ig_md, tm);
            }
        } else if (meta.local == 1 && hdr.udp.isValid() && meta.port_diff_local == 0) {
            admission.apply(hdr, meta, prsr, dprsr);
            if (meta.verdict == VERDICT_HANDSHAKE) {
                meta.descriptor = 1;
                meta.send = OUT_REPLY;
            } else if (meta.verdict != VERDICT_DROP) {
                slots.apply(hdr, meta);
            }
            if (meta.send != OUT_NONE) {
                reply.apply(hdr, meta, ig_md, tm);
            }
            events.apply(hdr, meta);
        } else if (meta.local == 0 && hdr.eth.isValid()) {
            forward.apply(hdr, meta, tm);
        }
        if (meta.send == OUT_NONE) {
            dprsr.drop_ctl = 1;
        }
        hdr.bridge.setValid();
        hdr.bridge.send = meta.send;
        hdr.bridge.job_index = meta.job_index;
        hdr.bridge.sent = meta.sent_index;
        hdr.bridge.ingress_port = ig_md.ingress_port;
    }
}

control NcinaEgress(inout egress_headers_t hdr, inout egress_meta_t meta,
                    in egress_intrinsic_metadata_t eg_md,
                    in egress_intrinsic_metadata_from_parser_t prsr,
                    inout egress_intrinsic_metadata_for_deparser_t dprsr,
                    inout egress_intrinsic_metadata_for_output_port_t oport) {
    Rewrite() rewrite;

    apply {
        rewrite.apply(hdr, eg_md, dprsr);
    }
}

Pipeline(NcinaIngressParser(), NcinaIngress(), NcinaIngressDeparser(),
         NcinaEgressParser(), NcinaEgress(), NcinaEgressDeparser()) pipe;

Switch(pipe) main;
