"""Typed configuration: the base every algorithm's config builds on (:mod:`qrl.configs.base`)
and one module per algorithm. A run's config is written to Redis once
(:func:`qrl.runs.create_run`) and read back by every role that joins."""

from qrl.configs.base import Config, ConfigError, parse_config

__all__ = ["Config", "ConfigError", "parse_config"]
