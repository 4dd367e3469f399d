"""The worker side of ncina: chunking, the slot window, retransmission, and training integration."""
