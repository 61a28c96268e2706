"""What several bench families share: paths, workload generators, summary statistics."""
