// SwitchML's slot rules with docs/protocol.md's L1-L4, in the order a Tofino pipeline can run
// them (docs/tofino.md, "Slots"): each register is read and written by one register action per
// packet, so the state is laid out so that every write depends only on what earlier stages
// found. Per slot version the held chunk's offset (`offsets`); per slot, both versions'
// contributors (`held`), and a replica of them (`mirror`) that answers, in the same stage,
// with the other version's contributors.
#ifndef NCINA_TOFINO_SLOTS_P4
#define NCINA_TOFINO_SLOTS_P4

struct versions_t {
    bit<32> v0;
    bit<32> v1;
}

control Slots(inout headers_t hdr, inout meta_t meta) {
#ifndef NCINA_DENSE
    LaneSums() sums;
#endif
#ifdef NCINA_PASSES
    Regions() regions;  // (lanes.p4: the pairs' index region)
#endif

    // The offset of each slot version's chunk. OFFSET_UNUSED: every offset in [0, 2^30) is
    // newer (serial arithmetic mod 2^32), so a version's first chunk claims it.
    Register<bit<32>, bit<16>>(NCINA_SLOTS, OFFSET_UNUSED) offsets;
    // A newer chunk claims the version (a worker sends one only after the round it replaces
    // completed and every worker moved on: docs/tofino.md); the answer says older/newer/same.
    RegisterAction<bit<32>, bit<16>, bit<4>>(offsets) claim = {
        void apply(inout bit<32> value, out bit<4> rv) {
            bool newer = (int<32>)(hdr.nc.offset - value) > 0;
            bool same = value == hdr.nc.offset;
            rv = this.predicate(newer, same);
            if (newer) {
                value = hdr.nc.offset;
            }
        }
    };

    // Contributors of each version's round (HELD_UNUSED: no round yet, which counts as
    // complete). `held` answers with the packet's version, `mirror` with the other one.
    Register<versions_t, bit<16>>(NCINA_PAIRS, {HELD_UNUSED, HELD_UNUSED}) held;
    Register<versions_t, bit<16>>(NCINA_PAIRS, {HELD_UNUSED, HELD_UNUSED}) mirror;

    // The held chunk again: the rank joins an incomplete round (a duplicate changes nothing).
    // The first chunk of a round: it starts once the other version's round is complete (L1),
    // and that round's contributors are forgotten (HELD_UNUSED: complete, nobody): a rank in
    // them has not left the new round, whose result it may have lost (without this, once a
    // slot had used both versions, every retransmission for a complete round was `late` and a
    // lost result was never sent again: found by the v1model twin, docs/tofino.md).
#define NCINA_VERSION_ACTIONS(reg, out_, here, there)                                          \
    RegisterAction<versions_t, bit<16>, bit<32>>(reg) reg##_join_##here = {                 \
        void apply(inout versions_t value, out bit<32> rv) {                                \
            rv = value.out_;                                                                \
            if (value.here < meta.full) {                                                   \
                value.here = value.here | meta.rank_bit;                                    \
            }                                                                               \
        }                                                                                   \
    };                                                                                      \
    RegisterAction<versions_t, bit<16>, bit<32>>(reg) reg##_start_##here = {                \
        void apply(inout versions_t value, out bit<32> rv) {                                \
            rv = value.out_;                                                                \
            if (value.there >= meta.full) {                                                 \
                value.here = meta.rank_bit;                                                 \
                value.there = HELD_UNUSED;                                                  \
            }                                                                               \
        }                                                                                   \
    };
    NCINA_VERSION_ACTIONS(held, v0, v0, v1)
    NCINA_VERSION_ACTIONS(held, v1, v1, v0)
    NCINA_VERSION_ACTIONS(mirror, v1, v0, v1)
    NCINA_VERSION_ACTIONS(mirror, v0, v1, v0)
#undef NCINA_VERSION_ACTIONS

    action late() {
        meta.event = EV_LATE;
    }

    // A notice holding `bitmap`; a restart notice holds none (the header alone).
    action restart_notice() {
        meta.notice = 1;
        meta.send = OUT_REPLY;
        meta.event2 = EV_NOTICES_SENT;
    }

    action notice(bit<32> bitmap) {
        restart_notice();
        hdr.notice.setValid();
        hdr.notice.high = 0;
        hdr.notice.low = bitmap;
    }

    action contribute(bit<8> op) {
        meta.event = EV_CONTRIBUTIONS;
        meta.lane_op = op;
    }

    action complete() {
        meta.event2 = EV_SLOTS_COMPLETED;
        meta.send = OUT_MULTICAST;
    }

    // What the contributors say about this rank (a table's action: Tofino tests a field
    // against a constant only). `left`: ranks still missing once this one is added.
    action tally() {
        meta.seen_here = meta.held & meta.rank_bit;
        meta.seen_there = meta.others & meta.rank_bit;
        meta.room_here = meta.held - meta.full;
        meta.room_there = meta.others - meta.full;
        meta.left = meta.full_less_rank - meta.held;
    }

    table tallies {
        actions = { tally; }
        const default_action = tally();
        size = 1;
    }

    apply {
#ifdef NCINA_HARVEST
        if (meta.lane_op != LANE_HARVEST) {  // (a result's second pass: its upper lanes only)
#endif
        if (meta.verdict == VERDICT_STALE) {
            restart_notice();  // a packet from before a restart: the header alone
            return;
        }
        meta.relation = claim.execute(meta.slot_index);
#ifdef NCINA_PASSES
        regions.apply(hdr, meta);  // the pairs' index, once claim has read the slot's
#endif
        if (meta.relation == OFFSET_OLDER) {
            late();  // L2-L4: a chunk before the held one
            return;
        }
        if (meta.relation == OFFSET_SAME) {
            if (hdr.nc.flags[2:2] == 0) {
                meta.held = held_join_v0.execute(meta.pair_index);
                meta.others = mirror_join_v0.execute(meta.pair_index);
            } else {
                meta.held = held_join_v1.execute(meta.pair_index);
                meta.others = mirror_join_v1.execute(meta.pair_index);
            }
        } else {
            if (hdr.nc.flags[2:2] == 0) {
                meta.held = held_start_v0.execute(meta.pair_index);
                meta.others = mirror_start_v0.execute(meta.pair_index);
            } else {
                meta.held = held_start_v1.execute(meta.pair_index);
                meta.others = mirror_start_v1.execute(meta.pair_index);
            }
        }
        tallies.apply();
        if (meta.relation == OFFSET_NEWER) {
            if (meta.room_there[31:31] == 0) {
                contribute(LANE_FIRST);  // the round's first contribution
                if (meta.full_less_rank == 0) {
                    complete();
                }
            } else if (meta.seen_there != 0) {
                late();  // L1: it waits for the other round
            } else {
                meta.event = EV_CHUNK_MISMATCH;
            }
        } else if (meta.room_here[31:31] == 0) {  // the round is complete
            if (meta.seen_there != 0) {
                late();  // L3: the rank left this round
            } else {
                // The worker lost the result: the sums again, to it alone.
                meta.event = EV_RESULTS_RESENT;
                meta.lane_op = LANE_READ;
                meta.send = OUT_REPLY;
            }
        } else if (meta.seen_here != 0) {
            meta.event = EV_DUPLICATES;
            if (meta.generation != 0) {
                notice(meta.held);
            }
        } else {
            contribute(LANE_ADD);
            if (meta.left == 0) {
                complete();
            }
        }
#ifdef NCINA_HARVEST
        }
#endif
#ifndef NCINA_DENSE  // (the dense layout's pairs come last in ingress: p4/tofino/ncina.p4)
        if (meta.lane_op != LANE_NONE) {
            sums.apply(hdr, meta);
        }
#endif
    }
}

#endif
