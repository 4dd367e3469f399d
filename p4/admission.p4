// Admission of a datagram sent to the aggregator: the checks of docs/protocol.md, "Order of
// checks", in that order (as every backend), each failure counted under its reason.
// Parse-level faults count under the job the header names, or globally when it names none.
#ifndef NCINA_ADMISSION_P4
#define NCINA_ADMISSION_P4

control Admission(inout headers_t hdr, inout meta_t meta, in standard_metadata_t sm) {
    Members() members;
    CheckCodes() check_codes;

    action set_job(bit<8> index, bit<8> workers, bit<16> k, bit<16> pool, bit<32> slot_base,
                   bit<8> emin, bit<8> e_max, bit<7> max_code, bit<8> result_format,
                   bit<4> generation, bit<64> seed, bit<48> restart_idle) {
        meta.job_index = index;
        meta.workers = workers;
        meta.k = k;
        meta.pool = pool;
        meta.slot_base = slot_base;
        meta.emin = emin;
        meta.e_max = e_max;
        meta.max_code = max_code;
        meta.result_format = result_format;
        meta.generation = generation;
        meta.seed = seed;
        meta.restart_idle = restart_idle;
        meta.events = (bit<32>)index * NCINA_JOB_EVENTS;
        meta.member = (bit<32>)index * NCINA_MAX_WORKERS + (bit<32>)hdr.nc.rank;
    }

    table jobs {
        key = { hdr.nc.job: exact; }
        actions = { set_job; NoAction; }
        default_action = NoAction();
        size = NCINA_JOBS;
    }

    apply {
        bit<32> fault = 0;  // the first check that failed: its event number (0: none yet)
        bool is_member = false;
        bool same_host = false;
        meta.verdict = VERDICT_DROP;
        if (!hdr.nc.isValid() || hdr.udp.len < UDP_HEADER_BYTES + NCINA_HEADER_BYTES) {
            global_events.count(EV_G_TRUNCATED);
            return;
        }
        if (hdr.nc.version != NCINA_VERSION) {
            global_events.count(EV_G_BAD_VERSION);
            return;
        }
        // Job-independent checks (ncina.proto.header.parse).
        bit<16> room = hdr.udp.len - (UDP_HEADER_BYTES + NCINA_HEADER_BYTES);
        bit<16> tag_bytes = 0;
        if (hdr.nc.tag == 1) {
            tag_bytes = TAG_BYTES;
        }
        // A job datagram is the job handshake (ncina.aggregator.backends.python.handshake): of the
        // right length and count 1 it is answered (meta.status) with the job's descriptor, "no such
        // job" (counted as unknown_job), or, tagged (no BMv2 job has a key), "not authentic".
        bool handshake = hdr.nc.format == FORMAT_JOB;
        if (handshake) {
            if (room != DESCRIPTOR_BYTES + tag_bytes || sm.parser_error == error.PacketTooShort) {
                fault = EV_BAD_LENGTH;
            } else if (hdr.nc.count != 1) {
                fault = EV_BAD_COUNT;
            }
        } else if (hdr.nc.format > FORMAT_BLOB) {
            fault = EV_BAD_FORMAT;
        } else if (hdr.nc.count == 0) {
            fault = EV_BAD_COUNT;
        } else if (room < tag_bytes) {
            fault = EV_BAD_LENGTH;
        } else {
            bit<32> payload = (bit<32>)(room - tag_bytes);
            bit<32> count = (bit<32>)hdr.nc.count;
            if ((hdr.nc.format == FORMAT_NC8 && payload != count)
                    || (hdr.nc.format == FORMAT_INT && payload != count << 3)
                    || (hdr.nc.format == FORMAT_BLOB && payload == 0)
                    || sm.parser_error == error.PacketTooShort) {
                fault = EV_BAD_LENGTH;
            }
        }
        if (!jobs.apply().hit) {
            if (fault == EV_BAD_FORMAT) {
                global_events.count(EV_G_BAD_FORMAT);
            } else if (fault == EV_BAD_COUNT) {
                global_events.count(EV_G_BAD_COUNT);
            } else if (fault == EV_BAD_LENGTH) {
                global_events.count(EV_G_BAD_LENGTH);
            } else {
                global_events.count(EV_G_UNKNOWN_JOB);
                if (handshake) {  // the answer's descriptor fields are all 0
                    meta.status = STATUS_NO_SUCH_JOB;
                    meta.verdict = VERDICT_HANDSHAKE;
                    meta.result_format = 0;
                    meta.e_max = 0;
                    meta.emin = 0;
                    meta.workers = 0;
                    meta.pool = 0;
                    meta.k = 0;
                }
            }
            return;
        }
        job_events.count(meta.events + EV_PACKETS_IN);
        job_epoch.read(meta.epoch, (bit<32>)meta.job_index);
        // The rank's address check (applied once: a hello asks whether it comes from the
        // rank's known host, a chunk whether it is the member's).
        if (hdr.nc.rank < (bit<16>)meta.workers) {
            members.apply(hdr, meta, is_member, same_host);
        }
        if (fault != 0) {
            job_events.count(meta.events + fault);
            return;
        }
        if (handshake) {
            if (hdr.nc.result == 1) {
                job_events.count(meta.events + EV_BAD_FLAGS);
                return;
            }
            meta.status = STATUS_OK;
            if (hdr.nc.tag == 1) {
                meta.status = STATUS_NOT_AUTHENTIC;
            } else {
                // docs/protocol.md, "A new set of workers": a hello that says a new set has
                // come (ncina.aggregator.members.Members.new_set_comes: a rank of the set with
                // another incarnation nonce, from its known host; or, the job quiet for its
                // restart_idle, a hello without a nonce or a first one while no rank said one)
                // and finds the job idle (no round partly filled) starts it afresh: a new
                // epoch, every round, learned member and nonce forgotten.
                bit<32> nonce = hdr.nc.offset;
                bool in_range = hdr.nc.rank < (bit<16>)meta.workers;
                bit<32> held = 0;
                bit<32> said = 0;
                if (in_range) {
                    member_nonce_epoch.read(said, meta.member);
                    if (said == meta.epoch + 1) {
                        member_nonce.read(held, meta.member);
                    }
                }
                bit<32> open;
                bit<48> busy_at;
                bit<32> nonced;
                job_open.read(open, (bit<32>)meta.job_index);
                job_busy_at.read(busy_at, (bit<32>)meta.job_index);
                job_nonced.read(nonced, (bit<32>)meta.job_index);
                bit<2> comes = 0;  // 1: the quiet rule; 2: a rank's new incarnation
                if (nonce == 0 || nonce != held) {
                    if (nonce != 0 && held != 0 && hdr.nc.retx == 0 && same_host) {
                        comes = 2;
                    }
                    if (comes == 0 && sm.ingress_global_timestamp - busy_at >= meta.restart_idle
                            && (nonce == 0 || nonced != meta.epoch + 1)) {
                        comes = 1;
                    }
                }
                if (comes != 0 && open == 0) {
                    meta.epoch = meta.epoch + 1;
                    job_epoch.write((bit<32>)meta.job_index, meta.epoch);
                    held = 0;
                    if (comes == 2) {
                        job_gated.write((bit<32>)meta.job_index, meta.epoch + 1);
                    }
                }
                // A hello joins its rank to this start; a probe (RETX) asks and does not join.
                if (in_range) {
                    if (hdr.nc.retx == 1) {
                        bit<1> joined;
                        member_joined.read(joined, meta.member);
                        meta.unjoined = ~joined;
                    } else {
                        member_joined.write(meta.member, 1);
                        // The rank's first nonce in the set; in a gated set, its address too.
                        if (nonce != 0 && held == 0) {
                            member_nonce.write(meta.member, nonce);
                            member_nonce_epoch.write(meta.member, meta.epoch + 1);
                            job_nonced.write((bit<32>)meta.job_index, meta.epoch + 1);
                            bit<32> gated;
                            bit<1> known;
                            bit<32> learned;
                            job_gated.read(gated, (bit<32>)meta.job_index);
                            member_known.read(known, meta.member);
                            member_epoch.read(learned, meta.member);
                            if (gated == meta.epoch + 1 && (known == 0 || learned != meta.epoch)) {
                                member_known.write(meta.member, 1);
                                member_epoch.write(meta.member, meta.epoch);
                                member_ip.write(meta.member, hdr.ipv4.src);
                                member_port.write(meta.member, hdr.udp.src_port);
                                member_mac.write(meta.member, hdr.eth.src);
                            }
                        }
                    }
                }
            }
            job_events.count(meta.events + EV_HANDSHAKES);
            meta.verdict = VERDICT_HANDSHAKE;
            return;
        }
        // The job's checks (ncina.aggregator.backends.python.admission.admit; the tag first, as
        // pipeline.py).
        if (hdr.nc.tag == 1) {
            fault = EV_BAD_TAG;  // no BMv2 job has a key: a tagged datagram is not the job's
        } else if (hdr.nc.result == 1) {
            fault = EV_BAD_FLAGS;
        } else if (hdr.nc.format != FORMAT_NC8) {
            fault = EV_BAD_FORMAT;
        } else if (hdr.nc.rank >= (bit<16>)meta.workers) {
            fault = EV_NON_MEMBER;
        } else {
            bit<1> joined;
            member_joined.read(joined, meta.member);
            // In a gated set, only a rank that said its hello in it is a member.
            bit<32> gated;
            bit<32> said;
            job_gated.read(gated, (bit<32>)meta.job_index);
            member_nonce_epoch.read(said, meta.member);
            if (gated == meta.epoch + 1 && said != meta.epoch + 1) {
                is_member = false;
            }
            if (!is_member) {
                fault = EV_NON_MEMBER;
            } else if (hdr.nc.emin != meta.emin) {
                fault = EV_WINDOW_MISMATCH;
            } else if (hdr.nc.slot >= meta.pool) {
                fault = EV_BAD_SLOT;
            } else if (hdr.nc.count > meta.k || sm.parser_error == error.StackOutOfBounds) {
                fault = EV_BAD_COUNT;
            } else if (hdr.nc.generation != 0
                    && (hdr.nc.generation != meta.generation || joined == 0)) {
                // After the header checks: the notice names a member, a slot of the pool. A
                // generation from a rank that said no hello to this start (member_joined) was
                // learned from an earlier start that drew the same one: stale too.
                if (meta.generation == 0) {
                    fault = EV_BAD_FLAGS;
                } else {
                    // Answered by a restart notice, the header alone: shorter than any packet
                    // that gets here, so a forged source gets no amplified reflection.
                    job_events.count(meta.events + EV_STALE_GENERATION);
                    meta.verdict = VERDICT_STALE;
                    return;
                }
            } else {
                check_codes.apply(hdr, meta);
                if (meta.bad_code == 1) {
                    fault = EV_BAD_CODE;
                }
            }
        }
        if (fault != 0) {
            job_events.count(meta.events + fault);
            return;
        }
        // A valid packet of a member: learn its address (first packet), count RETX, accept.
        member_known.write(meta.member, 1);
        member_epoch.write(meta.member, meta.epoch);
        member_ip.write(meta.member, hdr.ipv4.src);
        member_port.write(meta.member, hdr.udp.src_port);
        member_mac.write(meta.member, hdr.eth.src);
        if (hdr.nc.retx == 1) {
            job_events.count(meta.events + EV_RETX_SEEN);
        }
        meta.count = hdr.nc.count;
        meta.verdict = VERDICT_ACCEPT;
    }
}

#endif
