// State shared by ingress and egress: member addresses (learned or checked against configured
// ones, read back by egress to address each multicast copy) and the event counters the control
// plane turns into the stats document (ncina.aggregator.bmv2.layout names every index).
#ifndef NCINA_STATE_P4
#define NCINA_STATE_P4

register<bit<1>>(NCINA_JOBS * NCINA_MAX_WORKERS) member_known;
register<ip4_t>(NCINA_JOBS * NCINA_MAX_WORKERS) member_ip;
register<bit<16>>(NCINA_JOBS * NCINA_MAX_WORKERS) member_port;
register<mac_t>(NCINA_JOBS * NCINA_MAX_WORKERS) member_mac;

// Per job: NCINA_JOB_EVENTS counters from index job_index * NCINA_JOB_EVENTS. Byte counts are
// the frames that caused the event, as BMv2 counts them (the ingress frame's length).
counter(NCINA_JOBS * NCINA_JOB_EVENTS, CounterType.packets_and_bytes) job_events;
// IPv4 packets to the aggregator that no host would deliver as a UDP datagram (transport.p4).
counter(NCINA_TRANSPORT_EVENTS, CounterType.packets_and_bytes) transport_events;
// Datagrams to the aggregator that no installed job can claim.
counter(NCINA_GLOBAL_EVENTS, CounterType.packets_and_bytes) global_events;

#endif
