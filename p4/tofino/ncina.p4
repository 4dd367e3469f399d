// ncina's aggregation switch for Tofino (TNA), the twin of p4/ncina.p4 (docs/tofino.md). This
// file only wires the pieces together; config.p4 and lanes.p4 are generated for the lane count
// K (`make p4-tofino K=16`).
#include <core.p4>
#if __TARGET_TOFINO__ == 2
#include <t2na.p4>  // (Tofino 2's register actions hand back up to four words: the dense layout)
#else
#include <tna.p4>
#endif

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

#ifdef NCINA_PHV_PRAGMAS
NCINA_PHV_PRAGMAS  // (config.p4: above 32 lanes, where the compiler's own choice fails)
#endif
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
#ifdef NCINA_DENSE
    LaneSums() sums;
#endif
#ifdef NCINA_PASSES
    Decode() decode;
#endif

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
#ifndef NCINA_PASSES
        meta.learned_mac = hdr.eth.src;  // the member digest's: Reply rewrites the source
        meta.learned_ip = hdr.ipv4.src;
        meta.learned_port = hdr.udp.src_port;
#endif
#ifdef NCINA_DENSE
        meta.result_bytes = hdr.nc.count << 2;
#endif
    }

    table prepare {
        actions = { sizes; }
        const default_action = sizes();
        size = 1;
    }
#ifdef NCINA_PASSES
    // The member digest packs meta.local_*, which hold the packet's source address by the
    // deparser: Reply swaps them with the source it rewrites, and a packet Reply does not answer
    // gets them here (no PHV for a copy of its own: docs/tofino.md, "64 elements per packet";
    // only Reply and the digest read them).
    action keep_source() {
        meta.local_mac = hdr.eth.src;
        meta.local_ip = hdr.ipv4.src;
        meta.local_port = hdr.udp.src_port;
    }
#endif

#ifdef NCINA_HARVEST
    // A result leaves through the recirculation port: its upper lanes are read in a second
    // pass, which sends it as the first pass decided.
    action to_harvest() {
        meta.then = meta.send;
        meta.send = OUT_HARVEST;
        tm.ucast_egress_port = RECIRC_PORT;
        tm.mcast_grp_a = 0;
    }

#ifndef NCINA_PASSES  // (two passes: Admission's, in the job lookup's place)
    action from_harvest() {
        meta.local = 1;
        meta.port_diff_local = 0;
        meta.verdict = VERDICT_HARVEST;
        meta.lane_op = LANE_HARVEST;
        meta.slot_index = hdr.harvest.slot;
        meta.job_index = hdr.harvest.job_index;
        meta.sent_index = hdr.harvest.sent;
        meta.send = hdr.harvest.send;
    }
#endif
#endif
#ifdef NCINA_PASSES
    // Two passes (64 lanes): a packet of more than 32 lanes, whose first pass added lanes
    // 32-63 at the slot's second index region, goes round again whatever the decision, so that
    // lanes 0-31 get the same operation; a result then goes round twice more for the pairs'
    // upper sums (48-63, then 16-31: docs/tofino.md, "64 elements per packet").
    // (What the next pass needs goes straight into the bridge header, valid from the start:
    // no metadata for it, the PHV is full.)
    action to_pass(bit<8> verdict, bit<16> region) {
        hdr.bridge.then = meta.send;
        meta.send = OUT_HARVEST;
        tm.ucast_egress_port = RECIRC_PORT;
        tm.mcast_grp_a = 0;
        hdr.bridge.verdict = verdict;
        hdr.bridge.slot = meta.slot_index + region;
    }

    action to_second() {
        hdr.bridge.then = meta.send;
        meta.send = OUT_HARVEST;
        tm.ucast_egress_port = RECIRC_PORT;
        tm.mcast_grp_a = 0;
        hdr.bridge.verdict = meta.lane_op + VERDICT_HARVEST;  // VERDICT_SECOND_FIRST/ADD/READ
        hdr.bridge.slot = meta.slot_index - NCINA_SLOTS;  // lanes 0-31
    }
#endif

    // Every lookup that depends on nothing but the headers runs first, side by side (a Tofino
    // pipeline is 12 stages deep); admission only computes metadata.
    apply {
#ifdef NCINA_PASSES
        hdr.bridge.setValid();
        hdr.bridge.ingress_port = ig_md.ingress_port;
        decode.apply(hdr);  // the pass's lanes' codes as integers (a pass that adds)
        // No branch around admission for a pass from the recirculation port: Tofino 1 places
        // a branch's tables whole before anything after it (no long branches), and the
        // decode tables waited for admission's 4 stages. Admission takes such a pass's job,
        // slot and verdict from its pass header instead of the job lookup (from_harvest);
        // its checks run, their verdict not taken (docs/tofino.md, "64 elements per packet").
        if (hdr.ipv4.isValid() && !hdr.harvest.isValid()) {
            local_address.apply();
        }
        prepare.apply();
        admission.apply(hdr, meta, prsr);
#else
#ifdef NCINA_HARVEST
        if (hdr.harvest.isValid()) {
            from_harvest();  // the slot path below reads the pairs' upper sums, nothing else
        } else {
#endif
        if (hdr.ipv4.isValid()) {  // (an unparsed header's fields are another packet's)
            local_address.apply();
        }
        prepare.apply();
        admission.apply(hdr, meta, prsr);
#ifdef NCINA_HARVEST
        }
#endif
#endif
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
                if (meta.unknown_rank == 1 && meta.verdict == VERDICT_ACCEPT) {
                    dprsr.digest_type = DIGEST_MEMBER;  // the control plane learns the rank
                }
            }
#ifdef NCINA_DENSE
            meta.ours = 1;  // counted and answered below, after the lanes' pairs
#else
            events.apply(hdr, meta);
            if (meta.send != OUT_NONE) {
                reply.apply(hdr, meta, ig_md, tm);
            }
#endif
        } else if (meta.local == 0 && hdr.eth.isValid()) {
            forward.apply(hdr, meta, tm);
        }
#ifdef NCINA_DENSE
        // The lanes' pairs, then the counters and the replies, each its own block: the pairs
        // depend on the slot decision above, the counters and replies too, but not on each
        // other, so the compiler places them side by side after the decision. (The counters and
        // replies in the decision's block made the pairs wait for that whole block: 14 stages
        // at K = 32, docs/tofino.md "Density".) A pair's table does nothing where the decision
        // sets LANE_NONE (its rows read the decision's inputs: they do not wait for it).
        sums.apply(hdr, meta);
        if (meta.ours == 1) {
            events.apply(hdr, meta);
#ifdef NCINA_PASSES
            if (meta.lane_op == LANE_HARVEST) {
                if (meta.verdict == VERDICT_HARVEST) {  // sent as the first pass decided
                    if (meta.send == OUT_MULTICAST) {
                        tm.mcast_grp_a = hdr.harvest.group;
                    } else {
                        tm.ucast_egress_port = hdr.harvest.port;
                    }
                } else if (meta.verdict == VERDICT_HARVEST_SECOND) {  // then lanes 16-31
                    to_pass(VERDICT_HARVEST, -(bit<16>)NCINA_SLOTS);
                } else if (meta.send != OUT_NONE) {  // the second pass of a result: 48-63 next
                    to_pass(VERDICT_HARVEST_SECOND, NCINA_SLOTS);
                }
            } else {
                // keep_source where Reply does not run (an answered packet's source: Reply's
                // swap), so that both take one stage: keep_source in the slot rules' branch,
                // after the decision, made that branch a stage longer, and the pairs follow it.
                if (meta.send != OUT_NONE) {
                    reply.apply(hdr, meta, ig_md, tm);
                } else {
                    keep_source();
                }
                if (meta.lane_op != LANE_NONE) {
                    if (hdr.block.isValid()) {
                        to_second();  // lanes 0-31
                    } else if (meta.send != OUT_NONE) {
                        to_pass(VERDICT_HARVEST, 0);  // 32 lanes at most
                    }
                }
            }
#elif defined(NCINA_HARVEST)
            if (meta.lane_op == LANE_HARVEST) {  // sent as the first pass decided
                if (meta.send == OUT_MULTICAST) {
                    tm.mcast_grp_a = hdr.harvest.group;
                } else {
                    tm.ucast_egress_port = hdr.harvest.port;
                }
            } else if (meta.send != OUT_NONE) {
                reply.apply(hdr, meta, ig_md, tm);
                if (meta.lane_op != LANE_NONE) {
                    to_harvest();
                }
            }
#else
            if (meta.send != OUT_NONE) {
                reply.apply(hdr, meta, ig_md, tm);
            }
#endif
        }
#endif
        if (meta.send == OUT_NONE) {
            dprsr.drop_ctl = 1;
        }
        hdr.bridge.setValid();
        hdr.bridge.send = meta.send;
        hdr.bridge.job_index = meta.job_index;
        hdr.bridge.sent = meta.sent_index;
        hdr.bridge.wide = meta.wide;
#ifdef NCINA_PASSES
        hdr.bridge.group = meta.group;
#else
        hdr.bridge.ingress_port = ig_md.ingress_port;
#ifdef NCINA_HARVEST
        hdr.bridge.then = meta.then;
        hdr.bridge.slot = meta.slot_index;
        hdr.bridge.group = meta.group;
#endif
#endif
#ifdef NCINA_NC8_RESULTS
        hdr.bridge.use = meta.use;
#endif
    }
}

control NcinaEgress(inout egress_headers_t hdr, inout egress_meta_t meta,
                    in egress_intrinsic_metadata_t eg_md,
                    in egress_intrinsic_metadata_from_parser_t prsr,
                    inout egress_intrinsic_metadata_for_deparser_t dprsr,
                    inout egress_intrinsic_metadata_for_output_port_t oport) {
    Rewrite() rewrite;
#ifndef NCINA_DENSE
    Widen() widen;
#endif

#ifdef NCINA_NC8_RESULTS
    Recompress() recompress;
#endif

    apply {
#ifdef NCINA_NC8_RESULTS
        recompress.apply(hdr, meta);  // (reads the bridge header, which rewrite removes)
#endif
        rewrite.apply(hdr, eg_md, dprsr);
#ifdef NCINA_NC8_RESULTS
        if (meta.nc8 == 0) {
            widen.apply(hdr);
        }
#elif !defined(NCINA_DENSE)
        widen.apply(hdr);
#endif
    }
}

Pipeline(NcinaIngressParser(), NcinaIngress(), NcinaIngressDeparser(),
         NcinaEgressParser(), NcinaEgress(), NcinaEgressDeparser()) pipe;

Switch(pipe) main;
