// The event counters the control plane turns into the stats document, numbered as p4/state.p4's
// (ncina.aggregator.backends.bmv2.layout): index job_index * NCINA_JOB_EVENTS + event. A Tofino
// counter counts once per packet, so a packet's events are spread over one counter each:
// packets_in, the verdict (or the failed check), a second event (slots_completed, notices_sent)
// and retx_seen (results_sent is counted by egress, per copy); the control plane adds them up
// at each index.
#ifndef NCINA_TOFINO_EVENTS_P4
#define NCINA_TOFINO_EVENTS_P4

control Events(in headers_t hdr, inout meta_t meta) {
    Counter<bit<32>, bit<16>>(NCINA_JOBS * NCINA_JOB_EVENTS, CounterType_t.PACKETS_AND_BYTES) job_in;
    Counter<bit<32>, bit<16>>(NCINA_JOBS * NCINA_JOB_EVENTS, CounterType_t.PACKETS_AND_BYTES) job_events;
    Counter<bit<32>, bit<16>>(NCINA_JOBS * NCINA_JOB_EVENTS, CounterType_t.PACKETS_AND_BYTES) job_more;
    Counter<bit<32>, bit<16>>(NCINA_JOBS * NCINA_JOB_EVENTS, CounterType_t.PACKETS_AND_BYTES) job_retx;
    Counter<bit<32>, bit<16>>(NCINA_GLOBAL_EVENTS, CounterType_t.PACKETS_AND_BYTES) global_events;

    // The counters' indexes, in a table's action: a register or counter index must be a field.
    action index() {
        meta.in_index = meta.events + EV_PACKETS_IN;
        meta.event_index = meta.events + meta.event;
        meta.event2_index = meta.events + meta.event2;
        meta.retx_index = meta.events + EV_RETX_SEEN;
        meta.sent_index = meta.events + EV_RESULTS_SENT;
    }

    table indexes {
        actions = { index; }
        const default_action = index();
        size = 1;
    }

    apply {
        if (meta.global_event != NO_GLOBAL_EVENT) {
            global_events.count(meta.global_event);
        } else if (meta.job_hit == 1) {
            indexes.apply();
            job_in.count(meta.in_index);
            if (meta.event != 0) {
                job_events.count(meta.event_index);
            }
            if (meta.event2 != 0) {
                job_more.count(meta.event2_index);
            }
            if (meta.verdict == VERDICT_ACCEPT && meta.retx == 1) {
                job_retx.count(meta.retx_index);
            }
        }
    }
}

#endif
