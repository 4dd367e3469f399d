// Wire formats (docs/protocol.md) and the pipeline's metadata.
// NCINA_K, NCINA_SLOTS and the event numbers come from the generated config.p4.
#ifndef NCINA_HEADERS_P4
#define NCINA_HEADERS_P4

typedef bit<48> mac_t;
typedef bit<32> ip4_t;

const bit<16> ETHERTYPE_IPV4 = 0x0800;
const bit<16> ETHERTYPE_ARP = 0x0806;
const bit<8> IP_PROTO_UDP = 17;
const bit<16> ARP_REQUEST = 1;
const bit<16> ARP_REPLY = 2;

const bit<8> NCINA_VERSION = 1;
const bit<8> FORMAT_NC8 = 0;
const bit<8> FORMAT_INT = 1;
const bit<8> FORMAT_BLOB = 2;
const bit<8> FORMAT_JOB = 3;
const bit<8> NC8_ROUNDING = 1;  // the revision of the nc8 results' rounding word: CRC-32
// Bytes before the ncina header (Ethernet 14, IPv4 20, UDP 8) and of the header itself.
const bit<16> UDP_HEADER_BYTES = 8;
const bit<16> NCINA_HEADER_BYTES = 16;
const bit<16> NOTICE_BYTES = 8;
const bit<16> TAG_BYTES = 8;
const bit<16> DESCRIPTOR_BYTES = 17;
// The job handshake's answer (docs/protocol.md "Job handshake", ncina.proto.descriptor).
const bit<8> STATUS_OK = 0;
const bit<8> STATUS_NO_SUCH_JOB = 1;
const bit<8> STATUS_NOT_AUTHENTIC = 2;
const bit<32> FRAME_OVERHEAD = 42;

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

// IPv4 options (a header length above 5 words): accepted and skipped, as a host does.
header ipv4_options_h {
    varbit<320> data;
}

header udp_h {
    bit<16> src_port;
    bit<16> dst_port;
    bit<16> len;
    bit<16> checksum;
}

// The 16-byte ncina header; the flags byte is split into its fields (bit 7 first).
header ncina_h {
    bit<8> version;
    bit<1> tag;
    bit<4> generation;
    bit<1> pool;
    bit<1> retx;
    bit<1> result;
    bit<8> format;
    bit<8> emin;
    bit<16> job;
    bit<16> rank;
    bit<16> slot;
    bit<16> count;
    bit<32> offset;
}

// One NC8 code: sign, exponent code (0 is zero, c >= 1 is 2^(emin + c - 1)).
header lane_h {
    bit<1> sign;
    bit<7> code;
}

// Eight NC8 codes side by side (the first lane the most significant byte): a chunk whose
// count is a multiple of 8 is parsed and answered as these (docs/bmv2.md, "Wide lanes").
header codes_h {
    bit<64> v;
}

// One element of an `int` result: the exact sum in units of 2^emin, two's complement.
header wide_lane_h {
    bit<64> value;
}

// Eight elements of an `int` result side by side (the first lane the most significant 64
// bits): a result's full groups of 8 are these, only its last count % 8 elements `wide_lane_h`
// (docs/bmv2.md, "Idle headers").
header wide_group_h {
    bit<512> v;
}

// A notice's payload: the ranks whose contribution the slot holds.
header notice_h {
    bit<64> bitmap;
}

// A job datagram's payload: the job as the sender holds it (fixed fields, so that a table
// entry's action parameters can fill the answer).
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

struct headers_t {
    ethernet_h eth;
    arp_h arp;
    ipv4_h ipv4;
    ipv4_options_h ipv4_options;
    udp_h udp;
    ncina_h nc;
    notice_h notice;
    descriptor_h desc;
    codes_h[NCINA_GROUPS] codes;
    lane_h[NCINA_TAIL] lanes;
    wide_group_h[NCINA_GROUPS] wide_groups;
    wide_lane_h[NCINA_TAIL] wide;
}

// What leaves ingress: nothing, a result for every member, one datagram back to the sender,
// or an ordinary frame (unicast, or flooded to every other port).
const bit<8> OUT_NONE = 0;
const bit<8> OUT_MULTICAST = 1;
const bit<8> OUT_REPLY = 2;
const bit<8> OUT_FORWARD = 3;
const bit<8> OUT_FLOOD = 4;

struct meta_t {
    bit<128> codes_seen;      // parser: bit c set for each lane whose code is c
    ip4_t target;             // the address asked for (ARP) or sent to (IPv4)
    bit<1> local;             // target is the aggregator's address
    mac_t local_mac;
    ip4_t local_ip;
    bit<16> local_port;
    bit<4> local_generation;  // the switch's generation (answers for no job carry it too)
    bit<8> send;              // OUT_*: what leaves the pipeline
    bit<1> datagram;          // an IPv4/UDP datagram to the aggregator that a host would take
    // The job, from the jobs table.
    bit<8> job_index;
    bit<8> workers;
    bit<16> k;
    bit<16> pool;
    bit<32> slot_base;
    bit<8> emin;
    bit<8> e_max;
    bit<7> max_code;
    bit<8> result_format;
    bit<4> generation;
    bit<64> seed;             // of the nc8 results' rounding bits (docs/protocol.md)
    bit<32> epoch;            // the job's epoch: state of another epoch is forgotten
    bit<48> restart_idle;     // microseconds the job must be quiet before a hello restarts it
    bit<32> events;           // first counter index of the job's events
    bit<32> member;           // member register index of the packet's rank
    // The slot.
    bit<32> slot_index;       // register index of (slot, version)
    bit<32> other_index;      // register index of (slot, 1 - version)
    bit<1> first;             // first contribution to (slot, version)
    bit<1> bad_code;          // a lane's code is above the window
    bit<16> count;            // the chunk's element count
    bit<8> verdict;           // VERDICT_*: what admission decided
    bit<8> lane_op;           // LANE_*: what the lanes do with the slot
    bit<32> result_use;       // completions of the slot version before this one
    bit<32> result_key;       // the nc8 result's key (docs/protocol.md, "Re-compression")
    bit<1> notice;            // the reply is a notice, not a result
    bit<1> descriptor;        // the reply is the job handshake's answer
    bit<8> status;            // its status (STATUS_*)
    bit<1> unjoined;          // a probe's rank has not said hello to this start: the answer's RETX
    // One lane at a time (the generated LaneSums): its sum and the NC8 re-compression's steps.
    bit<64> lane_sum;
    bit<64> lane_magnitude;
    bit<8> lane_code;
    bit<2> lanes_form;        // LANES_* (lanes.p4): how the parser took the codes
    bit<64> code_room;        // 127 - max_code in each byte (the groups' window check)
    bit<NCINA_CELL_BITS> cell;     // a group's cell of lane sums
    bit<NCINA_LANE_BITS> unbias;   // workers * 2^62: a lane's bias in a complete cell
    bit<8> result_version;    // the slot version (hdr.nc.pool) as the result key's byte
}

// Admission's verdict on an ncina datagram.
const bit<8> VERDICT_DROP = 0;
const bit<8> VERDICT_ACCEPT = 1;
const bit<8> VERDICT_STALE = 2;
const bit<8> VERDICT_HANDSHAKE = 3;   // a job datagram to answer (meta.status says how)

// The lanes' work on a slot (the generated LaneSums control).
const bit<8> LANE_NONE = 0;
const bit<8> LANE_ADD = 1;        // add the contribution
const bit<8> LANE_COMPLETE = 2;   // add it, then encode the slot's result into the packet
const bit<8> LANE_RESEND = 3;     // put the slot's stored result into the packet
const bit<8> LANE_NOTICE = 4;     // drop the lanes (a notice carries none)

#endif
