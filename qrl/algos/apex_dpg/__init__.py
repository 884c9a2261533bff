"""Ape-X DPG (Horgan et al. 2018; TD3's learner, Fujimoto et al. 2018): config, builder and maths;
its actor and learner are qrl/actors/apex_dpg.py and qrl/learners/apex_dpg.py."""
