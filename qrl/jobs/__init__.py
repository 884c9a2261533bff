"""Whole jobs: starting one role from a spec, qrl train, a checkpoint's policy, the ACL users."""
