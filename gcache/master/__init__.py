"""gcache-master: the Raft-replicated control plane (membership, epochs, heartbeats, drains)."""
