// SwitchML's slot rules (docs/protocol.md, "Slots, pool versions and loss recovery" and "Late
// and duplicate packets", L1-L4 in order) for an admitted packet: per (slot, version) a bitmap
// of contributors, a count since the first, the chunk's offset and count; the sums and stored
// results live in the lanes (LaneSums).
#ifndef NCINA_SLOTS_P4
#define NCINA_SLOTS_P4

control Slots(inout headers_t hdr, inout meta_t meta, inout standard_metadata_t sm) {
    register<bit<64>>(NCINA_SLOTS) bitmaps;
    register<bit<8>>(NCINA_SLOTS) seen;
    register<bit<32>>(NCINA_SLOTS) offsets;
    register<bit<16>>(NCINA_SLOTS) counts;
    register<bit<32>>(NCINA_SLOTS) epochs;  // the job epoch of the version's round (state.p4)
    register<bit<32>>(NCINA_SLOTS) rounds;  // rounds begun in the version (a first contribution)
    // Per slot version and rank: the round (upper 32 bits) whose result was sent again to the
    // rank, and how often (lower 8), and when the last went (BMv2's clock, microseconds): rule
    // 2's budget, NCINA_RESEND_BURST a round, then one per NCINA_RESEND_INTERVAL_US.
    register<bit<40>>(NCINA_SLOTS * NCINA_MAX_WORKERS) resends;
    register<bit<48>>(NCINA_SLOTS * NCINA_MAX_WORKERS) resent_at;
    LaneSums() sums;

    // A reply to the packet's sender: a notice (LaneSums drops the lanes), holding `bitmap`.
    action restart_notice() {
        meta.lane_op = LANE_NOTICE;
        meta.notice = 1;
        meta.send = OUT_REPLY;
    }

    action notice(bit<64> bitmap) {
        restart_notice();
        hdr.notice.setValid();
        hdr.notice.bitmap = bitmap;
    }

    apply {
        meta.lane_op = LANE_NONE;
        if (meta.verdict == VERDICT_STALE) {
            restart_notice();  // a packet from before a restart: the header alone
        } else {
            bit<32> version = (bit<32>)hdr.nc.pool;
            bit<32> slot = (bit<32>)hdr.nc.slot;
            bit<32> pool = (bit<32>)meta.pool;
            meta.slot_index = meta.slot_base + version * pool + slot;
            meta.other_index = meta.slot_base + (1 - version) * pool + slot;

            bit<64> bitmap;
            bit<8> contributions;
            bit<32> offset;
            bit<16> count;
            bit<64> other;
            bit<8> other_contributions;
            bitmaps.read(bitmap, meta.slot_index);
            seen.read(contributions, meta.slot_index);
            offsets.read(offset, meta.slot_index);
            counts.read(count, meta.slot_index);
            bitmaps.read(other, meta.other_index);
            seen.read(other_contributions, meta.other_index);
            // A version last used in an earlier epoch of the job holds no round.
            bit<32> epoch;
            epochs.read(epoch, meta.slot_index);
            if (epoch != meta.epoch) {
                bitmap = 0;
                contributions = 0;
                offset = 0;
                count = 0;
            }
            epochs.read(epoch, meta.other_index);
            if (epoch != meta.epoch) {
                other = 0;
                other_contributions = 0;
            }
            bit<64> rank_bit = (bit<64>)1 << (bit<8>)hdr.nc.rank;
            // docs/protocol.md, "Late and duplicate packets": the held chunk, and whether the
            // packet's offset is the held one or before it (serial arithmetic mod 2^32).
            bool same = contributions != 0 && offset == hdr.nc.offset && count == hdr.nc.count;
            bool not_after = offset - hdr.nc.offset < 32w0x80000000;
            bool older = offset != hdr.nc.offset && not_after;
            bool complete = contributions >= meta.workers;

            if ((other & rank_bit) != 0 && other_contributions < meta.workers) {
                job_events.count(meta.events + EV_LATE);  // L1: it waits for the other round
            } else if ((bitmap & rank_bit) != 0 && !same) {
                if (older) {  // L2
                    job_events.count(meta.events + EV_LATE);
                } else {
                    job_events.count(meta.events + EV_CHUNK_MISMATCH);
                }
            } else if ((bitmap & rank_bit) != 0) {
                if (complete) {
                    // The worker lost the result: the stored one, to it alone, within the
                    // round's budget (docs/protocol.md, rule 2).
                    bit<32> round;
                    bit<40> resent;
                    bit<32> cell = meta.slot_index * NCINA_MAX_WORKERS + (bit<32>)hdr.nc.rank;
                    rounds.read(round, meta.slot_index);
                    resends.read(resent, cell);
                    bit<8> times = 0;
                    if (resent[39:8] == round) {
                        times = resent[7:0];
                    }
                    bit<48> last;
                    resent_at.read(last, cell);
                    bit<48> now = sm.ingress_global_timestamp;
                    if (times >= NCINA_RESEND_BURST && now - last < NCINA_RESEND_INTERVAL_US) {
                        job_events.count(meta.events + EV_RESEND_LIMIT);
                    } else {
                        if (times < NCINA_RESEND_BURST) {
                            times = times + 1;
                        }
                        resends.write(cell, round ++ times);
                        resent_at.write(cell, now);
                        job_busy_at.write((bit<32>)meta.job_index, sm.ingress_global_timestamp);
                        job_events.count(meta.events + EV_RESULTS_RESENT);
                        meta.lane_op = LANE_RESEND;
                        meta.send = OUT_REPLY;
                    }
                } else {
                    job_events.count(meta.events + EV_DUPLICATES);
                    if (meta.generation != 0) {
                        notice(bitmap);
                    }
                }
            } else if (bitmap != 0 && !same) {
                if (older) {  // L3
                    job_events.count(meta.events + EV_LATE);
                } else {
                    job_events.count(meta.events + EV_CHUNK_MISMATCH);
                }
            } else if (bitmap != 0 && complete) {
                job_events.count(meta.events + EV_LATE);  // L3: it left this round
            } else if (bitmap == 0 && contributions != 0 && not_after) {
                job_events.count(meta.events + EV_LATE);  // L4: the last round, or older
            } else {
                meta.first = 0;
                bit<32> open;
                job_open.read(open, (bit<32>)meta.job_index);
                if (bitmap == 0) {
                    meta.first = 1;
                    contributions = 0;
                    offsets.write(meta.slot_index, hdr.nc.offset);
                    counts.write(meta.slot_index, hdr.nc.count);
                    epochs.write(meta.slot_index, meta.epoch);
                    bit<32> round;
                    rounds.read(round, meta.slot_index);
                    rounds.write(meta.slot_index, round + 1);
                    open = open + 1;
                }
                bitmaps.write(meta.slot_index, bitmap | rank_bit);
                bitmaps.write(meta.other_index, other & ~rank_bit);
                contributions = contributions + 1;
                seen.write(meta.slot_index, contributions);
                job_events.count(meta.events + EV_CONTRIBUTIONS);
                meta.lane_op = LANE_ADD;
                if (contributions == meta.workers) {
                    open = open - 1;
                    job_busy_at.write((bit<32>)meta.job_index, sm.ingress_global_timestamp);
                    job_events.count(meta.events + EV_SLOTS_COMPLETED);
                    meta.lane_op = LANE_COMPLETE;
                    meta.send = OUT_MULTICAST;
                    sm.mcast_grp = (bit<16>)meta.job_index + 1;
                }
                job_open.write((bit<32>)meta.job_index, open);
            }
        }
        if (meta.lane_op != LANE_NONE) {
            sums.apply(hdr, meta);
        }
    }
}

#endif
