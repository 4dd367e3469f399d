// Admission of a datagram sent to the aggregator: the checks of docs/protocol.md, "Order of
// checks", each failure counted under its reason (as p4/admission.p4). Tofino reads or learns a
// member's address in one register action, so the checks that follow membership in that order
// are computed first: a rank is learned only from a packet that passes every check.
#ifndef NCINA_TOFINO_ADMISSION_P4
#define NCINA_TOFINO_ADMISSION_P4

control Admission(inout headers_t hdr, inout meta_t meta,
                  in ingress_intrinsic_metadata_from_parser_t prsr,
                  inout ingress_intrinsic_metadata_for_deparser_t dprsr) {
    CheckCodes() check_codes;
    // Member addresses learned from their first valid packet (0: not yet known).
    Register<bit<32>, bit<16>>(NCINA_JOBS * NCINA_MAX_WORKERS, 0) member_ips;
    Register<bit<16>, bit<16>>(NCINA_JOBS * NCINA_MAX_WORKERS, 0) member_ports;

    RegisterAction<bit<32>, bit<16>, bit<32>>(member_ips) learn_ip = {
        void apply(inout bit<32> value, out bit<32> rv) {
            rv = value;
            if (value == 0) {
                value = hdr.ipv4.src;
            }
        }
    };
    RegisterAction<bit<32>, bit<16>, bit<32>>(member_ips) read_ip = {
        void apply(inout bit<32> value, out bit<32> rv) {
            rv = value;
        }
    };
    RegisterAction<bit<16>, bit<16>, bit<16>>(member_ports) learn_port = {
        void apply(inout bit<16> value, out bit<16> rv) {
            rv = value;
            if (value == 0) {
                value = hdr.udp.src_port;
            }
        }
    };
    RegisterAction<bit<16>, bit<16>, bit<16>>(member_ports) read_port = {
        void apply(inout bit<16> value, out bit<16> rv) {
            rv = value;
        }
    };

    action set_job(bit<8> index, bit<16> workers, bit<16> k, bit<16> pool, bit<16> slot_base,
                   bit<16> pair_base, bit<8> emin, bit<8> e_max, bit<8> code_offset,
                   bit<8> result_format, bit<4> generation, bit<8> flags, bit<32> full, bit<16> events,
                   bit<16> members) {
        meta.job_hit = 1;
        meta.job_index = index;
        meta.workers = workers;
        meta.k = k;
        meta.pool = pool;
        meta.slot_base = slot_base;
        meta.pair_base = pair_base;
        meta.emin = emin;
        meta.e_max = e_max;
        meta.code_offset = code_offset;
        meta.result_format = result_format;
        meta.generation = generation;
        meta.flags = flags;
        meta.full = full;
        meta.events = events;
        meta.member = members + hdr.nc.rank;
        // The job handshake's answer (used if this is one): the job as the switch holds it.
        hdr.desc.mode = result_format;
        hdr.desc.e_max = e_max;
        hdr.desc.e_min = emin;
        hdr.desc.workers = workers;
        hdr.desc.pool = pool;
        hdr.desc.k = k;
        hdr.desc.keyed = 0;
        hdr.desc.reserved = 0;
        hdr.desc.compressor = 0;
        meta.slot_index = slot_base + hdr.nc.slot;
        meta.pair_index = pair_base + hdr.nc.slot;
    }

    // No such job: a handshake's answer carries zeros.
    action no_job() {
        meta.job_hit = 0;
        hdr.desc.mode = 0;
        hdr.desc.e_max = 0;
        hdr.desc.e_min = 0;
        hdr.desc.workers = 0;
        hdr.desc.pool = 0;
        hdr.desc.k = 0;
        hdr.desc.keyed = 0;
        hdr.desc.reserved = 0;
        hdr.desc.compressor = 0;
    }

    table jobs {
        key = { hdr.nc.job: exact; }
        actions = { set_job; no_job; }
        default_action = no_job();
        size = NCINA_JOBS;
    }

    // 1 << rank (Tofino shifts by constants only).
    action set_rank_bit(bit<32> bit_) {
        meta.rank_bit = bit_;
    }

    table rank_bits {
        key = { hdr.nc.rank: exact; }
        actions = { set_rank_bit; NoAction; }
        default_action = NoAction();
        size = NCINA_MAX_WORKERS;
        const entries = { RANK_BIT_ENTRIES }
    }

    action expect(ip4_t ip, bit<16> port) {
        meta.member_ip = ip;
        meta.member_port = port;
    }

    table members {
        key = {
            meta.job_index: exact;
            hdr.nc.rank: exact;
        }
        actions = { expect; NoAction; }
        default_action = NoAction();
        size = NCINA_JOBS * NCINA_MAX_WORKERS;
    }

    // Tofino compares a field with a constant only: every other comparison of the checks is a
    // difference computed here (a table's action keeps the compiler from folding it back).
    action measure() {
        meta.room = hdr.udp.len - (UDP_HEADER_BYTES + NCINA_HEADER_BYTES);
        meta.int_bytes = hdr.nc.count << 3;
        meta.rank_room = hdr.nc.rank - meta.workers;
        meta.slot_room = hdr.nc.slot - meta.pool;
        meta.count_room = meta.k - hdr.nc.count;
        meta.emin_diff = hdr.nc.emin ^ meta.emin;
        meta.generation_diff = hdr.nc.flags[6:3] ^ meta.generation;
        meta.full_less_rank = meta.full - meta.rank_bit;
    }

    table measures {
        actions = { measure; }
        const default_action = measure();
        size = 1;
    }

    action lengths() {
        meta.nc8_excess = meta.room - hdr.nc.count;
        meta.int_excess = meta.room - meta.int_bytes;
    }

    table excess {
        actions = { lengths; }
        const default_action = lengths();
        size = 1;
    }

    action address_check() {
        meta.ip_diff = meta.member_ip ^ hdr.ipv4.src;
        meta.port_diff = meta.member_port ^ hdr.udp.src_port;
    }

    table addresses {
        actions = { address_check; }
        const default_action = address_check();
        size = 1;
    }

    apply {
        bit<16> first = 0;   // checks before membership (0: passed)
        bit<16> later = 0;   // checks after it
        bool handshake = hdr.nc.format == FORMAT_JOB;
        bool tagged = hdr.nc.flags[7:7] == 1;
        bool stale = false;
        meta.verdict = VERDICT_DROP;
        meta.global_event = NO_GLOBAL_EVENT;
        jobs.apply();
        bool rank_known = rank_bits.apply().hit;
        check_codes.apply(hdr, meta);
        measures.apply();
        excess.apply();
        if (meta.room[15:15] == 1) {  // UDP length below 24
            meta.global_event = EV_G_TRUNCATED;
            return;
        }
        if (hdr.nc.version != NCINA_VERSION) {
            meta.global_event = EV_G_BAD_VERSION;
            return;
        }
        // The payload is room - 8 with a tag: each length compared with and without one.
        bool short = prsr.parser_err != 0;
        if (handshake) {
            if (short || (tagged && meta.room != DESCRIPTOR_BYTES + TAG_BYTES)
                    || (!tagged && meta.room != DESCRIPTOR_BYTES)) {
                first = EV_BAD_LENGTH;
            } else if (hdr.nc.count != 1) {
                first = EV_BAD_COUNT;
            }
        } else if (hdr.nc.format > FORMAT_BLOB) {
            first = EV_BAD_FORMAT;
        } else if (hdr.nc.count == 0) {
            first = EV_BAD_COUNT;
        } else if (short || (tagged && meta.room < TAG_BYTES)) {
            first = EV_BAD_LENGTH;
        } else if (hdr.nc.format == FORMAT_NC8) {
            if ((tagged && meta.nc8_excess != TAG_BYTES) || (!tagged && meta.nc8_excess != 0)) {
                first = EV_BAD_LENGTH;
            }
        } else if (hdr.nc.format == FORMAT_INT) {
            if ((tagged && meta.int_excess != TAG_BYTES) || (!tagged && meta.int_excess != 0)) {
                first = EV_BAD_LENGTH;
            }
        } else if ((tagged && meta.room == TAG_BYTES) || (!tagged && meta.room == 0)) {
            first = EV_BAD_LENGTH;  // a blob with no bytes
        }
        if (meta.job_hit == 0) {
            if (first == EV_BAD_FORMAT) {
                meta.global_event = EV_G_BAD_FORMAT;
            } else if (first == EV_BAD_COUNT) {
                meta.global_event = EV_G_BAD_COUNT;
            } else if (first == EV_BAD_LENGTH) {
                meta.global_event = EV_G_BAD_LENGTH;
            } else {
                meta.global_event = EV_G_UNKNOWN_JOB;
                if (handshake) {  // the answer's descriptor fields are all 0
                    meta.status = STATUS_NO_SUCH_JOB;
                    meta.verdict = VERDICT_HANDSHAKE;
                }
            }
            return;
        }
        if (first != 0) {
            meta.event = first;
            return;
        }
        if (handshake) {
            if (hdr.nc.flags[0:0] == 1) {
                meta.event = EV_BAD_FLAGS;
            } else {
                meta.status = STATUS_OK;
                if (tagged) {
                    meta.status = STATUS_NOT_AUTHENTIC;
                }
                meta.event = EV_HANDSHAKES;
                meta.verdict = VERDICT_HANDSHAKE;
            }
            return;
        }
        if (tagged) {
            first = EV_BAD_TAG;  // no Tofino job has a key
        } else if (hdr.nc.flags[0:0] == 1) {
            first = EV_BAD_FLAGS;
        } else if (hdr.nc.format != FORMAT_NC8) {
            first = EV_BAD_FORMAT;
        } else if (!rank_known || meta.rank_room[15:15] == 0) {
            first = EV_NON_MEMBER;  // rank >= workers
        }
        if (meta.emin_diff != 0) {
            later = EV_WINDOW_MISMATCH;
        } else if (hdr.nc.slot[15:10] != 0 || meta.slot_room[15:15] == 0) {
            later = EV_BAD_SLOT;
        } else if (meta.count_room[15:15] == 1) {
            later = EV_BAD_COUNT;
        } else if (hdr.nc.flags[6:3] != 0 && meta.generation_diff != 0) {
            if (meta.generation == 0) {
                later = EV_BAD_FLAGS;
            } else {
                stale = true;
            }
        } else if (meta.codes_bad == 1) {
            later = EV_BAD_CODE;
        }
        if (first != 0) {
            meta.event = first;
            return;
        }
        // Membership: the configured address, else the learned one (learned now if the packet
        // passes everything else, and told to the control plane by a digest).
        bool configured = members.apply().hit;
        bool learn = later == 0 && !stale;
        if (!configured) {
            if (learn) {
                meta.member_ip = learn_ip.execute(meta.member);
                meta.member_port = learn_port.execute(meta.member);
            } else {
                meta.member_ip = read_ip.execute(meta.member);
                meta.member_port = read_port.execute(meta.member);
            }
        }
        addresses.apply();
        if (!configured && meta.member_ip == 0) {
            if (learn) {  // learned now
                dprsr.digest_type = DIGEST_MEMBER;
            }
        } else if (meta.ip_diff != 0) {
            meta.event = EV_NON_MEMBER;
            return;
        } else if (meta.port_diff != 0) {
            meta.event = EV_NON_MEMBER;
            return;
        }
        if (stale) {
            meta.event = EV_STALE_GENERATION;
            meta.verdict = VERDICT_STALE;
        } else if (later != 0) {
            meta.event = later;
        } else {
            meta.verdict = VERDICT_ACCEPT;
        }
    }
}

#endif
