// The v1model twin of the Tofino program p4/tofino/ (docs/tofino.md, "The v1model twin"): what
// the TNA program computes, run on BMv2. It includes the TNA program's headers, admission
// (verdict table), reply and switching controls as they are, behind the few TNA names they
// use (shims below), and the generated config.p4 and lanes.p4 of the same generator
// (ncina.aggregator.backends.tofino.gen); what a v1model program must write otherwise (parser,
// slot registers, counters, egress) is in this folder, one file per TNA file it stands for.
#define V1MODEL_VERSION 20200408  // typedef PortId_t, as TNA names ports
#include <core.p4>
#include <v1model.p4>

#define NCINA_TWIN

// TNA's names for what the shared controls read and write (v1model's PortId_t is TNA's): ingress_port,
// the parser's error, and the traffic manager's unicast port and multicast group, which
// NcinaIngress copies into standard_metadata at the end.
typedef bit<16> MulticastGroupId_t;
struct ingress_intrinsic_metadata_t {
    PortId_t ingress_port;
}
struct ingress_intrinsic_metadata_from_parser_t {
    bit<16> parser_err;
}
struct ingress_intrinsic_metadata_for_tm_t {
    PortId_t ucast_egress_port;
    MulticastGroupId_t mcast_grp_a;
}

#include "config.p4"
#include "../tofino/headers.p4"
#include "parser.p4"
#include "lanes.p4"
#include "../tofino/switching.p4"
#include "members.p4"
#include "../tofino/admission.p4"
#include "slots.p4"
#include "../tofino/reply.p4"
#include "events.p4"
#include "rewrite.p4"

// NcinaIngress of p4/tofino/ncina.p4's dense layout (config.p4's NCINA_DENSE), statement for
// statement but for the harvest pass (none: a v1model register read hands back both sums of
// a pair); where the TNA program sets a digest for the control plane, the twin sends
// v1model's (members.p4).
control NcinaIngress(inout headers_t hdr, inout meta_t meta, inout standard_metadata_t sm) {
    Arp() arp;
    Forward() forward;
    Admission() admission;
    Slots() slots;
    Reply() reply;
    Events() events;
    Learn() learn;
    LaneSums() sums;

    ingress_intrinsic_metadata_t ig_md;
    ingress_intrinsic_metadata_from_parser_t prsr;
    ingress_intrinsic_metadata_for_tm_t tm;

    // The aggregator's own address (one entry): aggregated on its UDP port.
    action aggregator(mac_t mac, bit<16> port, bit<8> flags) {
        meta.local = 1;
        meta.local_mac = mac;
        meta.local_ip = hdr.ipv4.dst;
        meta.local_port = port;
        meta.local_flags = flags;
        meta.port_diff_local = hdr.udp.dst_port ^ port;
    }

    table local_address {
        key = { hdr.ipv4.dst: exact; }
        actions = { aggregator; NoAction; }
        default_action = NoAction();
        size = 4;
    }

    action sizes() {
        meta.room = hdr.udp.len - (UDP_HEADER_BYTES + NCINA_HEADER_BYTES);
        meta.int_bytes = hdr.nc.count << 3;
        meta.result_bytes = hdr.nc.count << 2;
    }

    table prepare {
        actions = { sizes; }
        const default_action = sizes();
        size = 1;
    }

    apply {
        ig_md.ingress_port = sm.ingress_port;
        prsr.parser_err = sm.parser_error == error.NoError ? 16w0 : 16w1;
        tm.ucast_egress_port = 0;
        tm.mcast_grp_a = 0;
        if (hdr.ipv4.isValid()) {  // (an unparsed header's fields are another packet's)
            local_address.apply();
        }
        prepare.apply();
        admission.apply(hdr, meta, prsr);
        if (hdr.arp.isValid()) {
            arp.apply(hdr, meta, ig_md, tm);
            if (meta.send == OUT_NONE) {
                forward.apply(hdr, meta, tm);
            }
        } else if (meta.local == 1 && hdr.udp.isValid() && meta.port_diff_local == 0) {
            if (meta.verdict == VERDICT_HANDSHAKE) {
                meta.descriptor = 1;
                meta.send = OUT_REPLY;
            } else if (meta.verdict != VERDICT_DROP) {
                slots.apply(hdr, meta);
                if (meta.verdict == VERDICT_ACCEPT) {
                    // TNA: a digest for the control plane when meta.unknown_rank; the twin's
                    // also when a configured member's MAC address is not installed yet
                    learn.apply(hdr, meta);
                }
            }
            meta.ours = 1;  // counted and answered below, after the lanes' pairs
        } else if (meta.local == 0 && hdr.eth.isValid()) {
            forward.apply(hdr, meta, tm);
        }
        // The dense layout's order: the lanes' pairs (their rows read the slot decision's
        // inputs), then the counters and the replies (no harvest pass: a v1model register
        // read hands back both sums of a pair).
        sums.apply(hdr, meta);
        if (meta.ours == 1) {
            events.apply(hdr, meta);
            if (meta.send != OUT_NONE) {
                reply.apply(hdr, meta, ig_md, tm);
            }
        }
        hdr.bridge.setValid();
        hdr.bridge.send = meta.send;
        hdr.bridge.job_index = meta.job_index;
        hdr.bridge.sent = meta.sent_index;
        hdr.bridge.wide = meta.wide;
        hdr.bridge.ingress_port = ig_md.ingress_port;
        if (meta.send == OUT_NONE) {
            mark_to_drop(sm);
        } else if (tm.mcast_grp_a != 0) {
            sm.mcast_grp = tm.mcast_grp_a;
        } else {
            sm.egress_spec = tm.ucast_egress_port;
        }
    }
}

control NcinaEgress(inout headers_t hdr, inout meta_t meta, inout standard_metadata_t eg_md) {
    Rewrite() rewrite;

    apply {
        rewrite.apply(hdr, eg_md);
    }
}

V1Switch(NcinaParser(), NcinaVerifyChecksum(), NcinaIngress(), NcinaEgress(),
         NcinaComputeChecksum(), NcinaDeparser()) main;
