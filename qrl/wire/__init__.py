"""The wire: the codec and message schemas' machinery, Redis key names, connections (one node or a
Redis Cluster), fault handling, streams and the weight store. Imports nothing else of qrl."""
