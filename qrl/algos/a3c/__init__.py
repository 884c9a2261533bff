"""A3C (Mnih et al. 2016): actor-learners pushing gradients to a Redis parameter server."""
