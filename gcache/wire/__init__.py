"""The store's foundation, shared by clients, nodes and masters: the frame format and
opcodes (protocol), page keys (keys), tenant tokens and challenge-response (auth), and the
pyverbs wrappers of the RDMA transport (rdma_verbs)."""
