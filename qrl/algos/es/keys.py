"""ES's key names."""

from __future__ import annotations

from qrl.wire.keys import RunKeys


def es_params(keys: RunKeys) -> str:
    """The master's parameters: hash {version (= generation), blob}."""
    return keys.key("es:params")


def es_results(keys: RunKeys) -> str:
    """The workers' results stream."""
    return keys.key("es:results")
