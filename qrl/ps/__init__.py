"""A parameter server on Redis (Gorila, A3C): workers push gradients, sharded servers apply
them and publish the parameters (:mod:`qrl.ps.server`, :mod:`qrl.ps.client`)."""
