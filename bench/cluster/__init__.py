"""Cluster benches: the ketama ring's remapping, the cluster client's overhead, failover and
migration on a local cluster."""
