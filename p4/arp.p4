// ARP responder for the aggregator's address: the data plane answers for itself, as the DPDK
// backend does (the interface it serves carries no kernel address).
#ifndef NCINA_ARP_P4
#define NCINA_ARP_P4

control Arp(inout headers_t hdr, inout meta_t meta, inout standard_metadata_t sm) {
    apply {
        hdr.arp.op = ARP_REPLY;
        hdr.arp.tha = hdr.arp.sha;
        hdr.arp.tpa = hdr.arp.spa;
        hdr.arp.sha = meta.local_mac;
        hdr.arp.spa = meta.local_ip;
        hdr.eth.dst = hdr.eth.src;
        hdr.eth.src = meta.local_mac;
        sm.egress_spec = sm.ingress_port;
        meta.send = OUT_FORWARD;
    }
}

#endif
