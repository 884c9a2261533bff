"""Reinforcement-learning pieces free of any algorithm: environments, networks, evaluation."""
