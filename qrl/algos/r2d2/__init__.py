"""R2D2 (Kapturowski et al. 2019): config, builder, sequence schema and learning rule; its actor
and learner are qrl/actors/r2d2.py and qrl/learners/r2d2.py."""
