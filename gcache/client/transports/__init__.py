"""How a client reaches one node: the Transport contract and TCP (base), same-host shared memory
(shm, shm_ops), RDMA (rdma, sharing shm_ops), and the `auto` choice between them (choose)."""
