"""Development tooling around a whole cluster on one machine: the launcher (LocalCluster and the
gcache-cluster CLI), network namespaces for real partitions, throwaway credentials, and the seeded
fault checker. Nothing a deployed master, node or client imports: that lives in gcache.cluster."""
