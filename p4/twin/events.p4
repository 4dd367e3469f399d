// The event counters of p4/tofino/events.p4 as v1model counters, one per event kind with the
// same names and indexes (ncina.aggregator.backends.bmv2.layout): packets_in, the verdict (or the
// failed check), a second event (slots_completed, notices_sent) and retx_seen; results_sent is
// counted by egress (rewrite.p4), per copy. The control plane adds them up at each index.
#ifndef NCINA_TWIN_EVENTS_P4
#define NCINA_TWIN_EVENTS_P4

control Events(in headers_t hdr, inout meta_t meta) {
    counter<bit<32>>(NCINA_JOBS * NCINA_JOB_EVENTS, CounterType.packets_and_bytes) job_in;
    counter<bit<32>>(NCINA_JOBS * NCINA_JOB_EVENTS, CounterType.packets_and_bytes) job_events;
    counter<bit<32>>(NCINA_JOBS * NCINA_JOB_EVENTS, CounterType.packets_and_bytes) job_more;
    counter<bit<32>>(NCINA_JOBS * NCINA_JOB_EVENTS, CounterType.packets_and_bytes) job_retx;
    counter<bit<32>>(NCINA_GLOBAL_EVENTS, CounterType.packets_and_bytes) global_events;

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
            global_events.count((bit<32>)meta.global_event);
        } else if (meta.job_hit == 1) {
            indexes.apply();
            job_in.count((bit<32>)meta.in_index);
            if (meta.event != 0) {
                job_events.count((bit<32>)meta.event_index);
            }
            if (meta.event2 != 0) {
                job_more.count((bit<32>)meta.event2_index);
            }
            if (meta.verdict == VERDICT_ACCEPT && meta.retx == 1) {
                job_retx.count((bit<32>)meta.retx_index);
            }
        }
    }
}

#endif
