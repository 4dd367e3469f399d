// Admission of a datagram sent to the aggregator: the checks of docs/protocol.md, "Order of
// checks", each failure counted under its reason (as p4/admission.p4). A Tofino pipeline is 12
// stages deep, so the checks are not a chain of `if`s: each is its own flag, computed side by
// side, and one ternary table (`verdicts`) picks the first that failed, in the protocol's order.
// Members are table entries (configured, or installed by the control plane from the digest of
// a rank's first valid packet: docs/tofino.md, "Members").
#ifndef NCINA_TOFINO_ADMISSION_P4
#define NCINA_TOFINO_ADMISSION_P4

// Where admission's differences are kept: a field of their own each; with two passes (64
// lanes: ingress's PHV is full) in place of the field each subtracts, which nothing else reads,
// so that four 16-bit containers hold what took eight.
#ifdef NCINA_PASSES
#define RANK_ROOM meta.workers
#define SLOT_ROOM meta.pool
#define COUNT_ROOM meta.k
#define INT_EXCESS meta.int_bytes
#else
#define RANK_ROOM meta.rank_room
#define SLOT_ROOM meta.slot_room
#define COUNT_ROOM meta.count_room
#define INT_EXCESS meta.int_excess
#endif

control Admission(inout headers_t hdr, inout meta_t meta,
                  in ingress_intrinsic_metadata_from_parser_t prsr) {
    CheckCodes() check_codes;

    action set_job(bit<8> index, MulticastGroupId_t group, bit<16> workers, bit<16> k, bit<16> pool, bit<16> slot_base,
                   bit<16> pair_base, bit<8> emin, bit<8> code_offset, bit<8> result_format,
                   bit<4> generation, bit<8> flags, bit<32> full, bit<16> events) {
        meta.job_hit = 1;
        meta.job_index = index;
        meta.group = group;
        meta.retx = hdr.nc.flags[1:1];
        meta.workers = workers;
        meta.k = k;
        meta.pool = pool;
        meta.emin = emin;
        meta.code_offset = code_offset;
        NCINA_CODE_OFFSETS(code_offset)
        meta.result_format = result_format;
        meta.generation = generation;
        meta.flags = flags;
        meta.full = full;
        meta.events = events;
        meta.slot_index = slot_base + hdr.nc.slot;
        meta.pair_index = pair_base + hdr.nc.slot;
    }

    // An entry per job and pool version: slot_base is the version's first slot.
    table jobs {
        key = {
            hdr.nc.job: exact;
            hdr.nc.flags[2:2]: exact @name("pool");
        }
        actions = { set_job; NoAction; }
        default_action = NoAction();
        size = 2 * NCINA_JOBS;
    }

    // 1 << rank (Tofino shifts by constants only); a miss: no rank of any job.
    action set_rank_bit(bit<32> bit_) {
        meta.rank_bit = bit_;
    }

#ifdef NCINA_PASSES
    // Two passes: each lookup's miss is a flag that `verdicts` reads (the one-pass `if`s on
    // the hits took a logical table each before it: docs/tofino.md, "64 elements per packet").
    action no_rank_bit() {
        meta.no_rank = 1;
    }

    action unknown_address() {
        meta.unknown_rank = 1;
    }

    action not_member() {
        meta.not_member = 1;
    }
#endif

    table rank_bits {
        key = { hdr.nc.rank: exact; }
#ifdef NCINA_PASSES
        actions = { set_rank_bit; no_rank_bit; }
        default_action = no_rank_bit();
#else
        actions = { set_rank_bit; NoAction; }
        default_action = NoAction();
#endif
        size = NCINA_MAX_WORKERS;
        const entries = { RANK_BIT_ENTRIES }
    }

    // A rank's address: `ranks` knows that it has one, `members` that it is this packet's.
    table ranks {
        key = {
            hdr.nc.job: exact;
            hdr.nc.rank: exact;
        }
#ifdef NCINA_PASSES
        actions = { NoAction; unknown_address; }
        default_action = unknown_address();
#else
        actions = { NoAction; }
#endif
        size = NCINA_JOBS * NCINA_MAX_WORKERS;
    }

    table members {
        key = {
            hdr.nc.job: exact;
            hdr.nc.rank: exact;
            hdr.ipv4.src: exact;
            hdr.udp.src_port: exact;
        }
#ifdef NCINA_PASSES
        actions = { NoAction; not_member; }
        default_action = not_member();
#else
        actions = { NoAction; }
#endif
        size = NCINA_JOBS * NCINA_MAX_WORKERS;
    }

    // Every comparison of two fields is a difference (Tofino compares a field with a constant
    // only), computed in a table's action so that the compiler keeps it a field.
    action measure() {
        RANK_ROOM = hdr.nc.rank - meta.workers;
        SLOT_ROOM = hdr.nc.slot - meta.pool;
        COUNT_ROOM = meta.k - hdr.nc.count;
        meta.emin_diff = hdr.nc.emin ^ meta.emin;
        meta.generation_diff = hdr.nc.flags[6:3] ^ meta.generation;
        meta.full_less_rank = meta.full - meta.rank_bit;
        meta.nc8_excess = meta.room - hdr.nc.count;
        INT_EXCESS = meta.room - meta.int_bytes;
    }

    table measures {
        actions = { measure; }
        const default_action = measure();
        size = 1;
    }

#ifdef NCINA_PASSES
    // A pass from the recirculation port (a packet's second pass, a result's harvest) does
    // what its pass header says: the job, the slot and the verdict come from there, not from
    // the job lookup and the checks (which run, unread: `verdicts` is not applied).
    action from_harvest() {
        meta.local = 1;
        meta.port_diff_local = 0;
        meta.verdict = hdr.harvest.verdict;  // the pairs' rows: VERDICT_SECOND_* or _HARVEST
        meta.group = hdr.harvest.group;
        hdr.bridge.ingress_port = hdr.harvest.port;  // the sender's (OUT_REPLY)
        meta.lane_op = LANE_HARVEST;
        meta.slot_index = hdr.harvest.slot;
        meta.job_index = hdr.harvest.job_index;
        meta.sent_index = hdr.harvest.sent;
        meta.send = hdr.harvest.send;
    }
#endif

#ifdef NCINA_PASSES
    // The checks that need no lookup, one ternary table of their first failure in `verdicts`'
    // order (generated rows: gen_tofino.header_check_rows), in place of an `if` per flag: each
    // took a logical table of stages 1 to 3, where the decode tables wait for room (docs/
    // tofino.md, "64 elements per packet"). The UDP length stands for the room `prepare`
    // computes from it, so the table needs nothing before it.
    action header_flags(bit<1> truncated, bit<1> bad_version, bit<1> handshake, bit<1> hs_len,
                        bit<1> hs_count, bit<1> format, bit<1> count0, bit<1> len,
                        bit<1> not_nc8) {
        meta.truncated = truncated;
        meta.bad_version = bad_version;
        meta.handshake = handshake;
        meta.f_hs_len = hs_len;
        meta.f_hs_count = hs_count;
        meta.f_format = format;
        meta.f_count0 = count0;
        meta.f_len = len;
        meta.f_not_nc8 = not_nc8;
    }

    @stage(0)
    table header_checks {
        key = {
            hdr.udp.len: ternary;
            hdr.nc.version: ternary;
            hdr.nc.format: ternary;
            hdr.nc.count: ternary;
            hdr.nc.flags[7:7]: ternary @name("tagged");
            prsr.parser_err: ternary;
        }
        actions = { header_flags; }
        const default_action = header_flags(0, 1, 0, 0, 0, 0, 0, 0, 0);  // another version
        size = NCINA_HEADER_CHECK_ROWS;
        const entries = { HEADER_CHECK_ENTRIES }
    }
#endif

    action verdict(bit<8> v, bit<16> event, bit<8> status) {
        meta.verdict = v;
        meta.event = event;
        meta.status = status;
    }

    action global(bit<16> event, bit<8> v) {
        meta.global_event = event;
        meta.verdict = v;
        meta.status = STATUS_NO_SUCH_JOB;
    }

    // The first failed check, in docs/protocol.md's order (first matching entry).
    table verdicts {
        key = {
            meta.truncated: ternary;
            meta.bad_version: ternary;
            meta.f_hs_len: ternary;
            meta.f_hs_count: ternary;
            meta.f_format: ternary;
            meta.f_count0: ternary;
            meta.f_len: ternary;
            meta.job_hit: ternary;
            meta.handshake: ternary;
            hdr.nc.flags[0:0]: ternary @name("result_flag");
            hdr.nc.flags[7:7]: ternary @name("tag_flag");
            meta.f_not_nc8: ternary;
#ifdef NCINA_PASSES
            // What the flags below read (gen_tofino.PASS_VERDICT_KEY: the rows' order)
            hdr.nc.format: ternary @name("format");
            meta.nc8_excess: ternary;
            INT_EXCESS: ternary @name("int_excess");
            meta.no_rank: ternary;
            RANK_ROOM[15:15]: ternary @name("rank_room");
            meta.unknown_rank: ternary;
            meta.not_member: ternary;
            meta.emin_diff: ternary;
            hdr.nc.slot[15:10]: ternary @name("slot_high");
            SLOT_ROOM[15:15]: ternary @name("slot_room");
            COUNT_ROOM[15:15]: ternary @name("count_room");
            hdr.nc.flags[6:3]: ternary @name("generation_flag");
            meta.generation_diff: ternary;
#else
            meta.f_rank: ternary;
            meta.f_address: ternary;
            meta.f_emin: ternary;
            meta.f_slot: ternary;
            meta.f_count: ternary;
            meta.f_generation: ternary;
#endif
            meta.generation: ternary;
            meta.codes_bad: ternary;
            NCINA_CODES_BAD_KEYS
        }
        actions = { verdict; global; }
        default_action = verdict(VERDICT_ACCEPT, 0, 0);
#ifdef NCINA_PASSES
        size = NCINA_VERDICT_ROWS;
#else
        size = 64;
#endif
        const entries = { VERDICT_ENTRIES }
    }

    apply {
#ifdef NCINA_PASSES
        // truncated ... f_not_nc8, but the lengths measures computes: first, so that it sits in
        // stage 0 (after the branch below, stage 1's TCAM took it from the window check)
        header_checks.apply();
        if (hdr.harvest.isValid()) {  // (one branch, one stage: beside the other lookups)
            from_harvest();
        } else {
            jobs.apply();
        }
#else
        jobs.apply();
#endif
#ifdef NCINA_PASSES
        rank_bits.apply();  // each miss a flag for `verdicts`
        ranks.apply();
        members.apply();
        check_codes.apply(hdr, meta);
        measures.apply();
        // The checks of the lookups and of measures' differences are `verdicts`' own rows
        // (gen_tofino.pass_verdict_rows); the others are header_checks', above.
#else
        bool rank_known = rank_bits.apply().hit;
        bool has_address = ranks.apply().hit;
        bool is_member = members.apply().hit;
        check_codes.apply(hdr, meta);
        measures.apply();
        bool tagged = hdr.nc.flags[7:7] == 1;
        bool short = prsr.parser_err != 0;
        if (meta.room[15:15] == 1) {  // a UDP length below 24
            meta.truncated = 1;
        }
        if (hdr.nc.version != NCINA_VERSION) {
            meta.bad_version = 1;
        }
        if (hdr.nc.format == FORMAT_JOB) {
            meta.handshake = 1;
            if (short || (tagged && meta.room != DESCRIPTOR_BYTES + TAG_BYTES)
                    || (!tagged && meta.room != DESCRIPTOR_BYTES)) {
                meta.f_hs_len = 1;
            }
            if (hdr.nc.count != 1) {
                meta.f_hs_count = 1;
            }
        } else {
            if (hdr.nc.format > FORMAT_BLOB) {
                meta.f_format = 1;
            }
            if (hdr.nc.count == 0) {
                meta.f_count0 = 1;
            }
            if (short || (tagged && meta.room[15:3] == 0)) {  // room < 8 with a tag
                meta.f_len = 1;
            }
        }
        // The payload is room - 8 with a tag: each length with and without one.
        if (hdr.nc.format == FORMAT_NC8) {
            if ((tagged && meta.nc8_excess != TAG_BYTES) || (!tagged && meta.nc8_excess != 0)) {
                meta.f_len = 1;
            }
        } else if (hdr.nc.format == FORMAT_INT) {
            if ((tagged && INT_EXCESS != TAG_BYTES) || (!tagged && INT_EXCESS != 0)) {
                meta.f_len = 1;
            }
        } else if (hdr.nc.format == FORMAT_BLOB) {
            if ((tagged && meta.room == TAG_BYTES) || (!tagged && meta.room == 0)) {
                meta.f_len = 1;
            }
        }
        if (hdr.nc.format != FORMAT_NC8) {
            meta.f_not_nc8 = 1;
        }
        if (!rank_known || RANK_ROOM[15:15] == 0) {  // rank >= workers
            meta.f_rank = 1;
        }
        if (has_address && !is_member) {
            meta.f_address = 1;
        }
        if (!has_address) {
            meta.unknown_rank = 1;
        }
        if (meta.emin_diff != 0) {
            meta.f_emin = 1;
        }
        if (hdr.nc.slot[15:10] != 0 || SLOT_ROOM[15:15] == 0) {
            meta.f_slot = 1;
        }
        if (COUNT_ROOM[15:15] == 1) {
            meta.f_count = 1;
        }
        if (hdr.nc.flags[6:3] != 0 && meta.generation_diff != 0) {
            meta.f_generation = 1;
        }
#endif
#ifdef NCINA_PASSES
        if (!hdr.harvest.isValid()) {
            verdicts.apply();
        }
#else
        verdicts.apply();
#endif
    }
}

#endif
