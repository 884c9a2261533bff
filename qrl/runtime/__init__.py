"""What every role and job shares, free of any algorithm: configs, runs in Redis, the role loop,
what an algorithm is to qrl, metrics, heartbeats and status, control, checkpoints, run files."""
