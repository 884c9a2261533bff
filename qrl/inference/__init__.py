"""Central inference (SEED RL, Espeholt et al. 2019): actors that only step environments
(:mod:`qrl.inference.stepper`, no torch) send each vector step's observations to an
inference server (:mod:`qrl.inference.server`), which batches the requests of many actors,
acts with the latest weights, answers each actor and assembles its unrolls for the learner.
The wire between them is :mod:`qrl.inference.protocol`."""
