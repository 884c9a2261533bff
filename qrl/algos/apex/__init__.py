"""Ape-X (Horgan et al. 2018): config and builder; its actor and learner are qrl/actors/apex.py and
qrl/learners/apex.py."""
