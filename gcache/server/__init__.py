"""gcache-server: the node daemon (configuration, admin endpoints, lifecycle).

The data path itself is native: gcache._native.Server (gcache_native/server/server.cpp).
"""
