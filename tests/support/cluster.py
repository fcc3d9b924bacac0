"""The local Redis Cluster of the tests: the launcher ``bench/cluster.py`` uses too."""

from bench.local_cluster import LocalCluster, free_cluster_port, start_cluster

__all__ = ["LocalCluster", "free_cluster_port", "start_cluster"]
