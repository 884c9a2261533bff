"""PPO (Schulman et al. 2017) with a pool of synchronous learners (OpenAI Five, DD-PPO): config,
builder, rollout schema, key names and GAE; its actor and learner are qrl/actors/ppo.py and
qrl/learners/ppo.py, the pool qrl/learners/group.py."""
