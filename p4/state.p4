// State shared by ingress and egress: member addresses (learned or checked against configured
// ones, read back by egress to address each multicast copy) and the event counters the control
// plane turns into the stats document (ncina.aggregator.backends.bmv2.layout names every index).
#ifndef NCINA_STATE_P4
#define NCINA_STATE_P4

register<bit<1>>(NCINA_JOBS * NCINA_MAX_WORKERS) member_known;
register<ip4_t>(NCINA_JOBS * NCINA_MAX_WORKERS) member_ip;
register<bit<16>>(NCINA_JOBS * NCINA_MAX_WORKERS) member_port;
register<mac_t>(NCINA_JOBS * NCINA_MAX_WORKERS) member_mac;
// A learned address holds in the job epoch it was learned in (member_epoch): a restart of the
// job (a hello that finds it idle, admission.p4) moves job_epoch on, which forgets every learned
// member and every slot version's round at once, lazily (slots.p4), with no loop over the pool.
register<bit<32>>(NCINA_JOBS * NCINA_MAX_WORKERS) member_epoch;
register<bit<32>>(NCINA_JOBS) job_epoch;
// 1: the rank said a hello to this start of the switch (admission.p4); only a new start (a new
// switch, its registers at 0) clears it, so a packet that carries the generation from a rank
// that did not was sent to an earlier start that may have drawn the same generation: stale.
register<bit<1>>(NCINA_JOBS * NCINA_MAX_WORKERS) member_joined;
// Slot versions of the job whose round is partly filled: the job is idle when there are none.
register<bit<32>>(NCINA_JOBS) job_open;
// When the job was last in use (a slot completed or a result sent again; BMv2's ingress clock,
// microseconds): a hello restarts it only once it has been quiet for its restart_idle.
register<bit<48>>(NCINA_JOBS) job_busy_at;
// The current set of workers (docs/protocol.md, "A new set of workers"): the incarnation nonce
// of each rank's first hello in the set, valid when member_nonce_epoch holds the job's epoch
// plus one (so a restart, a new epoch, forgets every nonce at once); job_nonced, the epoch plus
// one when some rank said a nonce in it; job_gated, the epoch plus one when a rank's new nonce
// started it (only the ranks that said their hello in it are members then).
register<bit<32>>(NCINA_JOBS * NCINA_MAX_WORKERS) member_nonce;
register<bit<32>>(NCINA_JOBS * NCINA_MAX_WORKERS) member_nonce_epoch;
register<bit<32>>(NCINA_JOBS) job_nonced;
register<bit<32>>(NCINA_JOBS) job_gated;

// Per job: NCINA_JOB_EVENTS counters from index job_index * NCINA_JOB_EVENTS. Byte counts are
// the frames that caused the event, as BMv2 counts them (the ingress frame's length).
counter(NCINA_JOBS * NCINA_JOB_EVENTS, CounterType.packets_and_bytes) job_events;
// IPv4 packets to the aggregator that no host would deliver as a UDP datagram (transport.p4).
counter(NCINA_TRANSPORT_EVENTS, CounterType.packets_and_bytes) transport_events;
// Datagrams to the aggregator that no installed job can claim.
counter(NCINA_GLOBAL_EVENTS, CounterType.packets_and_bytes) global_events;

#endif
