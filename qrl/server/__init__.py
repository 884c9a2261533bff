"""Redis infrastructure qrl starts itself: a private redis-server, a local Redis Cluster."""
