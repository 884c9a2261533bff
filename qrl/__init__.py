"""qrl: Redis-backed distributed reinforcement learning (Ape-X, IMPALA, Evolution Strategies)."""

__version__ = "0.1.0"
