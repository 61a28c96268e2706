"""Cluster pieces shared by the master, the nodes and the clients: the map and placement."""
