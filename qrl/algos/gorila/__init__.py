"""Gorila (Nair et al. 2015): DQN learners pushing gradients to a Redis parameter server."""
