// SwitchML's slot rules with docs/protocol.md's L1-L4 as p4/tofino/slots.p4 runs them
// (docs/tofino.md, "Slots"), with v1model registers: each of `offsets`, `held` and `mirror` is
// read and written once per packet, in the TNA program's order, the write depending only on
// the cell and on what earlier stages found, as a TNA register action's. From the tallies on
// (the rules and their actions), the text is the TNA program's, character for character
// (tests/test_tofino.py checks it).
//
// v1model registers start at 0, the TNA ones at their declared initial values: each cell holds
// its value xor that initial value (OFFSET_UNUSED, HELD_UNUSED), so a fresh switch holds the
// TNA program's initial state.
#ifndef NCINA_TWIN_SLOTS_P4
#define NCINA_TWIN_SLOTS_P4

// Both versions' initial contributors, v1 ++ v0.
const bit<64> HELD_UNUSED2 = (bit<32>)HELD_UNUSED ++ (bit<32>)HELD_UNUSED;

control Slots(inout headers_t hdr, inout meta_t meta) {
#ifndef NCINA_DENSE
    LaneSums() sums;
#endif

    // The offset of each slot version's chunk (xor OFFSET_UNUSED).
    register<bit<32>, bit<32>>(NCINA_SLOTS) offsets;
    // Contributors of each slot's two versions, v1 ++ v0 (each xor HELD_UNUSED); `mirror` is
    // the TNA program's replica (there: the other version's answer in the same stage), kept and
    // written identically.
    register<bit<64>, bit<32>>(NCINA_PAIRS) held;
    register<bit<64>, bit<32>>(NCINA_PAIRS) mirror;

    // One read-modify-write of a register of versions (v1 ++ v0): `here_out` gets the packet's
    // version, `there_out` the other one, as they were; then the packet's version is joined
    // (the held chunk again, a round not complete) or started (a newer chunk, the other
    // version's round complete: L1; that round's contributors are forgotten, as in the TNA
    // program's start actions).
#define NCINA_VERSIONS(reg, here_out, there_out)                                            \
        {                                                                                   \
            bit<64> cells;                                                                  \
            reg.read(cells, pair);                                                          \
            cells = cells ^ HELD_UNUSED2;                                   \
            bit<32> here = cells[31:0];                                                     \
            bit<32> there = cells[63:32];                                                   \
            if (hdr.nc.flags[2:2] == 1) {                                                   \
                here = cells[63:32];                                                        \
                there = cells[31:0];                                                        \
            }                                                                               \
            here_out = here;                                                                \
            there_out = there;                                                              \
            if (meta.relation == OFFSET_SAME) {                                             \
                if (here < meta.full) {                                                     \
                    here = here | meta.rank_bit;                                            \
                }                                                                           \
            } else if (there >= meta.full) {                                                \
                here = meta.rank_bit;                                                       \
                there = HELD_UNUSED;                                                        \
            }                                                                               \
            cells = there ++ here;                                                          \
            if (hdr.nc.flags[2:2] == 1) {                                                   \
                cells = here ++ there;                                                      \
            }                                                                               \
            reg.write(pair, cells ^ HELD_UNUSED2);                          \
        }

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
        if (meta.verdict == VERDICT_STALE) {
            restart_notice();  // a packet from before a restart: the header alone
            return;
        }
        // Register action `claim`: a newer chunk (serially) claims the version; the answer
        // says older/newer/same (OFFSET_*).
        bit<32> offset;
        offsets.read(offset, (bit<32>)meta.slot_index);
        offset = offset ^ OFFSET_UNUSED;
        meta.relation = OFFSET_OLDER;
        if ((int<32>)(hdr.nc.offset - offset) > 0) {
            meta.relation = OFFSET_NEWER;
            offsets.write((bit<32>)meta.slot_index, hdr.nc.offset ^ OFFSET_UNUSED);
        } else if (offset == hdr.nc.offset) {
            meta.relation = OFFSET_SAME;
        }
        if (meta.relation == OFFSET_OLDER) {
            late();  // L2-L4: a chunk before the held one
            return;
        }
        // Register actions held_(join|start)_v* and mirror_(join|start)_v*: each register's
        // write from its own cell; `held` answers with the packet's version, `mirror` with the
        // other one.
        bit<32> pair = (bit<32>)meta.pair_index;
        bit<32> unused;
        NCINA_VERSIONS(held, meta.held, unused)
        NCINA_VERSIONS(mirror, unused, meta.others)
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
