"""IMPALA (Espeholt et al. 2018): config, builder, unroll schema, key names and V-trace; its actor
and learner are qrl/actors/impala.py and qrl/learners/impala.py."""
