"""qrl: Redis-backed distributed reinforcement learning (Ape-X, Ape-X DPG, R2D2, IMPALA,
ES)."""

from qrl.rl import envs  # noqa: F401  (registers qrl's gymnasium tasks: qrl/CartPoleNoVel-v1)
from qrl.version import __version__


def load_policy(path, env_modules=()):  # type: ignore[no-untyped-def]
    """The trained (greedy) policy in a run directory or checkpoint file: ``.predict(obs)``
    for one observation or a batch, ``.algo``, ``.config``, ``.env_id``
    (:func:`qrl.jobs.policy.load_policy`; imports torch when called, not when qrl is imported).
    A checkpoint whose env id names a module (``module:EnvId``) loads only with that module
    in ``env_modules``: nothing a file names is imported unless you say so."""
    from qrl.jobs.policy import load_policy

    return load_policy(path, env_modules)


__all__ = ["__version__", "load_policy"]
