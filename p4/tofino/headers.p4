// Wire formats (docs/protocol.md) and the pipeline's metadata, for Tofino (TNA).
// The wire headers are p4/headers.p4's; an `int` element and a notice's bitmap are split into
// two 32-bit words (Tofino's PHV containers and ALUs are 32 bits wide at most).
// NCINA_K, NCINA_SLOTS, the event numbers and the per-lane structs come from config.p4.
#ifndef NCINA_TOFINO_HEADERS_P4
#define NCINA_TOFINO_HEADERS_P4

// The dense layout (config.p4's NCINA_DENSE, docs/tofino.md "Density"): pair registers and
// int32 results; on Tofino 1 a result's upper lanes are read in a second pass (the harvest).
#if defined(NCINA_DENSE) && __TARGET_TOFINO__ == 1
#define NCINA_HARVEST
#endif
// The two-pass layout (config.p4's NCINA_PASSES, docs/tofino.md "64 elements per packet"):
// lanes 0-31 in the first pass, 32-63 in a second, then the harvest passes (Tofino 1).
#if defined(NCINA_PASSES) && !defined(NCINA_HARVEST)
#error "the two-pass layout is built for Tofino 1 (--target tofino)"
#endif

typedef bit<48> mac_t;
typedef bit<32> ip4_t;

const bit<16> ETHERTYPE_IPV4 = 0x0800;
const bit<16> ETHERTYPE_ARP = 0x0806;
const bit<8> IP_PROTO_UDP = 17;
const bit<16> ARP_REPLY = 2;

const bit<8> NCINA_VERSION = 1;
const bit<8> FORMAT_NC8 = 0;
const bit<8> FORMAT_INT = 1;
const bit<8> FORMAT_BLOB = 2;
const bit<8> FORMAT_JOB = 3;
const bit<8> NC8_ROUNDING = 1;  // the revision of the nc8 results' rounding word: CRC-32
#if defined(NCINA_DENSE) || defined(NCINA_TWIN)
const bit<8> FORMAT_INT32 = 4;  // provisional: issue 33 item 2's int32 results (not yet a protocol format)
#endif
const bit<16> UDP_HEADER_BYTES = 8;
const bit<16> NCINA_HEADER_BYTES = 16;
const bit<16> NOTICE_BYTES = 8;
const bit<16> TAG_BYTES = 8;
const bit<16> DESCRIPTOR_BYTES = 17;
const bit<8> STATUS_OK = 0;
const bit<8> STATUS_NO_SUCH_JOB = 1;
const bit<8> STATUS_NOT_AUTHENTIC = 2;

header ethernet_h {
    mac_t dst;
    mac_t src;
    bit<16> ether_type;
}

header arp_h {
    bit<16> htype;
    bit<16> ptype;
    bit<8> hlen;
    bit<8> plen;
    bit<16> op;
    mac_t sha;
    ip4_t spa;
    mac_t tha;
    ip4_t tpa;
}

header ipv4_h {
    bit<4> version;
    bit<4> ihl;
    bit<8> tos;
    bit<16> total_len;
    bit<16> id;
    bit<3> flags;
    bit<13> frag_offset;
    bit<8> ttl;
    bit<8> protocol;
    bit<16> checksum;
    ip4_t src;
    ip4_t dst;
}

header udp_h {
    bit<16> src_port;
    bit<16> dst_port;
    bit<16> len;
    bit<16> checksum;
}

// The flags byte is one field (Tofino writes a container from at most two sources; the
// reply writes the byte whole): TAG [7], generation [6:3], POOL [2], RETX [1], RESULT [0].
header ncina_h {
    bit<8> version;
    bit<8> flags;
    bit<8> format;
    bit<8> emin;
    bit<16> job;
    bit<16> rank;
    bit<16> slot;
    bit<16> count;
    bit<32> offset;
}

// One NC8 code, sign in bit 7 (one 8-bit field: Tofino places a header's fields in whole
// bytes).
header lane_h {
    bit<8> code;
}

// One element of an `int` result: the 32-bit lane sum, sign-extended to the wire's 64 bits.
header wide_lane_h {
    bit<32> high;
    bit<32> low;
}

#if defined(NCINA_DENSE) || defined(NCINA_TWIN)
// One element of an int32 result: a lane's 32-bit sum (before it, the lane's decoded code).
header sum_lane_h {
    bit<32> value;
}
#endif

#ifdef NCINA_DENSE

// A pair register's cell: the sums of lanes j and j + K/2.
struct lane_pair_t {
    bit<32> lo;
    bit<32> hi;
}

// A result on its way to the harvest pass (Tofino 1): what the first pass decided, in front
// of the frame that the recirculation port brings back.
header harvest_h {
    bit<8> send;              // OUT_MULTICAST or OUT_REPLY, once the upper lanes are read
    bit<8> job_index;
    bit<16> sent;             // the job's results_sent counter
    bit<16> slot;             // the register index of (slot, version)
    MulticastGroupId_t group;
    @padding bit<7> _pad;
    PortId_t port;            // the sender's port (OUT_REPLY)
#ifdef NCINA_PASSES
    bit<8> verdict;           // what the pass does (the pairs' key): VERDICT_SECOND_*, _HARVEST*
#endif
}
#endif

// A notice's 64-bit bitmap (a Tofino job has at most NCINA_MAX_WORKERS <= 30 ranks: high is 0).
header notice_h {
    bit<32> high;
    bit<32> low;
}

header descriptor_h {
    bit<8> status;
    bit<8> mode;
    bit<8> e_max;
    bit<8> e_min;
    bit<16> workers;
    bit<16> pool;
    bit<16> k;
    bit<8> keyed;
    bit<8> reserved;
    bit<32> compressor;
    bit<8> rounding;          // the nc8 results' rounding word (ncina.proto.nc8.ROUNDING)
}

// What ingress tells egress about a frame (the traffic manager carries it in front of the
// frame; egress removes it): what it is, the job (multicast results) and where it came in.
header bridge_h {
    bit<8> send;
    bit<8> job_index;
    bit<16> sent;             // the job's results_sent counter
    bit<8> wide;              // 1: a result whose int lanes egress sign-extends
    @padding bit<7> _pad;
    PortId_t ingress_port;
#ifdef NCINA_HARVEST
    bit<8> then;              // OUT_HARVEST: how the result leaves after the harvest pass
    bit<16> slot;
    MulticastGroupId_t group;
#ifdef NCINA_PASSES
    bit<8> verdict;           // the next pass's harvest_h.verdict
#endif
#endif
#ifdef NCINA_NC8_RESULTS
    bit<32> use;              // the slot version's use of a result (egress's Recompress)
#endif
}

struct headers_t {
    bridge_h bridge;
    ethernet_h eth;
    arp_h arp;
    ipv4_h ipv4;
    udp_h udp;
    ncina_h nc;
    notice_h notice;
    descriptor_h desc;
    NCINA_LANE_HEADERS  // lane_h stacks of up to 32 (generated: config.p4)
#ifdef NCINA_DENSE
#ifdef NCINA_HARVEST
    harvest_h harvest;
#endif
    NCINA_SUM_HEADERS  // sum_lane_h stacks of up to 32 (generated: config.p4)
#ifdef NCINA_TWIN
    wide_lane_h[NCINA_K] wide;  // the twin's int results (docs/tofino.md, "The v1model twin")
#endif
#else
    wide_lane_h[NCINA_K] wide;
#endif
}

struct egress_headers_t {
    bridge_h bridge;
    ethernet_h eth;
    ipv4_h ipv4;
    udp_h udp;
    ncina_h nc;
    notice_h notice;
#ifdef NCINA_HARVEST
    harvest_h harvest;
#endif
#ifndef NCINA_DENSE
    wide_lane_h[NCINA_K] wide;
#endif
#ifdef NCINA_NC8_RESULTS
    lane_h[NCINA_K] lanes;    // an nc8 result's codes, re-compressed from `wide`
#endif
}

// A member learned from its first valid packet, for the control plane (it installs the
// egress address of the rank's copies: Tofino's egress cannot read ingress registers).
struct member_digest_t {
    bit<16> job;
    bit<16> rank;
    mac_t mac;
    ip4_t ip;
    bit<16> port;
}

const bit<16> NO_GLOBAL_EVENT = 0xFFFF;
const bit<3> DIGEST_MEMBER = 1;

const bit<8> OUT_NONE = 0;
const bit<8> OUT_MULTICAST = 1;
const bit<8> OUT_REPLY = 2;
const bit<8> OUT_FORWARD = 3;
const bit<8> OUT_FLOOD = 4;
const bit<8> OUT_HARVEST = 5;     // to the recirculation port, for the harvest pass

const bit<8> VERDICT_DROP = 0;
const bit<8> VERDICT_ACCEPT = 1;
const bit<8> VERDICT_STALE = 2;
const bit<8> VERDICT_HANDSHAKE = 3;
const bit<8> VERDICT_HARVEST = 4;  // a result's harvest pass (NCINA_HARVEST)
#ifdef NCINA_PASSES
// The second pass of the two-pass layout: lanes 0-31 get what the first pass's decision
// gave lanes 32-63 (VERDICT_HARVEST + its lane_op).
const bit<8> VERDICT_SECOND_FIRST = 5;
const bit<8> VERDICT_SECOND_ADD = 6;
const bit<8> VERDICT_SECOND_READ = 7;
// A result's harvest of lanes 48-63; then VERDICT_HARVEST reads 16-31 and sends it.
const bit<8> VERDICT_HARVEST_SECOND = 8;
#endif

// The held offset of a slot version against the packet's (the predicate of the offsets
// register action: bit (cmplo + 2 cmphi), cmplo = newer, cmphi = same).
const bit<4> OFFSET_OLDER = 1;
const bit<4> OFFSET_NEWER = 2;
const bit<4> OFFSET_SAME = 4;

// The lanes' work (LaneSums).
const bit<8> LANE_NONE = 0;
const bit<8> LANE_FIRST = 1;      // the round's first contribution: store it
const bit<8> LANE_ADD = 2;        // add the contribution
const bit<8> LANE_READ = 3;       // a lost result: read the sums again
const bit<8> LANE_HARVEST = 4;    // the harvest pass: read the pairs' upper sums
#ifdef NCINA_HARVEST
const PortId_t RECIRC_PORT = 68;  // pipe 0's recirculation port on Tofino 1
#endif

struct meta_t {
    ip4_t target;
    bit<1> local;
    bit<1> local_arp;
    bit<16> port_diff_local;  // the UDP destination port ^ the aggregator's
    mac_t local_mac;
    ip4_t local_ip;
    bit<16> local_port;
    bit<4> local_generation;
    bit<8> local_flags;       // a handshake answer's flags: RESULT and the switch's generation
    bit<8> send;
    // The job (table jobs).
    bit<1> job_hit;
    bit<8> job_index;
    MulticastGroupId_t group; // the job's multicast group (job_index + 1)
    bit<16> workers;
    bit<16> k;
    bit<16> pool;
    bit<8> emin;
    bit<8> code_offset;       // 127 - the window's largest code: a code above it sets bit 7
    bit<8> result_format;
    bit<4> generation;
    bit<8> flags;             // a reply's flags: RESULT and the job's generation
    bit<32> full;             // the job's complete bitmap, (1 << workers) - 1
    bit<16> events;           // first counter index of the job's events
    bit<32> rank_bit;         // 1 << rank (table rank_bits)
    // Admission: each check's flag (1: failed) and the differences it compares.
    bit<1> truncated;
    bit<1> bad_version;
    bit<1> handshake;
    bit<1> f_hs_len;
    bit<1> f_hs_count;
    bit<1> f_format;
    bit<1> f_count0;
    bit<1> f_len;
    bit<1> f_not_nc8;
#ifdef NCINA_PASSES
    bit<1> no_rank;           // no rank bit: rank >= the switch's 32 (rank_bits' miss)
    bit<1> not_member;        // another address than the member's, or none (members' miss)
#else
    bit<1> f_rank;
    bit<1> f_address;
    bit<1> f_emin;
    bit<1> f_slot;
    bit<1> f_count;
    bit<1> f_generation;
#endif
    bit<1> codes_bad;
    bit<1> retx;              // the packet's RETX flag (the reply rewrites the flags)
    bit<1> unknown_rank;      // no address for the rank yet: this packet's is learned
    bit<16> room;             // UDP payload bytes after the ncina header
    bit<16> int_bytes;        // count * 8
#if defined(NCINA_DENSE) || defined(NCINA_TWIN)
    bit<16> result_bytes;     // count * 4: an int32 result's payload (the twin: or count * 8)
#endif
#ifdef NCINA_HARVEST
    bit<8> then;              // a result sent to the harvest pass: how it leaves after it
#endif
#ifdef NCINA_DENSE
    bit<1> ours;              // a datagram to the aggregator's port: counted, maybe answered
#endif
#ifdef NCINA_PASSES
#endif
    bit<16> nc8_excess;       // room - count
    bit<16> int_excess;       // room - count * 8
    bit<16> rank_room;        // rank - workers (bit 15: a rank of the job)
    bit<16> slot_room;        // slot - pool (bit 15: a slot of the pool; slot < 1024)
    bit<16> count_room;       // k - count (bit 15: too many elements)
    bit<8> emin_diff;
    bit<4> generation_diff;
    bit<8> verdict;
    bit<8> status;
    bit<1> descriptor;
    bit<1> notice;
    bit<16> global_event;     // a global counter's index (NO_GLOBAL_EVENT: none)
    bit<16> event;            // counted events (0: none): the failed check or the verdict ...
    bit<16> event2;           // ... and a second (slots_completed, notices_sent)
    // The slot.
    bit<16> slot_index;       // register index of (slot, version)
    bit<16> pair_index;       // register index of the slot's pair of versions
    bit<4> relation;          // OFFSET_*
    bit<32> held;             // the version's contributors before this packet
    bit<32> others;           // the other version's contributors
    bit<32> full_less_rank;   // full - rank_bit
    bit<32> left;             // full - rank_bit - held: 0 when this rank completes the round
    bit<32> seen_here;        // held & rank_bit
    bit<32> seen_there;       // others & rank_bit
    bit<32> room_here;        // held - full (bit 31 set: the version is not complete)
    bit<32> room_there;       // others - full
    bit<8> lane_op;
    bit<8> wide;              // the packet leaves as a result with int lanes
    // Counter indexes (Events).
    bit<16> in_index;
    bit<16> event_index;
    bit<16> event2_index;
    bit<16> retx_index;
    bit<16> sent_index;
#ifndef NCINA_DENSE
    lane_values_t values;     // each lane's code as an integer (generated)
#endif
    lane_checks_t checks;     // each lane's code + code_offset (generated)
#ifdef NCINA_NC8_RESULTS
    bit<32> use;              // completions of the slot version before this result (uses)
#endif
#ifndef NCINA_PASSES
    // The member digest's source address, copied before Reply rewrites the packet's (the job
    // and rank it packs are the header's: ingress does not write them; two passes: local_*).
    mac_t learned_mac;
    ip4_t learned_ip;
    bit<16> learned_port;
#endif
}

struct egress_meta_t {
    bit<1> unused;
#ifdef NCINA_NC8_RESULTS
    bit<1> nc8;               // a result of a job of nc8 results (Recompress.results)
    bit<32> seed_hi;          // the job's seed
    bit<32> seed_lo;
    bit<8> version;           // the result's pool version
    bit<32> key;              // lane 0's rounding word
#endif
}

#endif
