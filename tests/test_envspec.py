"""The env spec (:mod:`qrl.rl.envspec`): read once by the code that makes roles and handed
to them, so no role makes an env only to read its spaces; what gymnasium reports about an
env's spaces is checked there."""

from __future__ import annotations

import threading
from functools import partial
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

from qrl.algos import ALGOS
from qrl.jobs.launch import RoleSpec, run_role
from qrl.rl.envspec import EnvSpec
from qrl.runtime.algorithm import RoleContext
from qrl.runtime.config import parse_config
from qrl.runtime.control import request_stop
from qrl.runtime.runs import create_run
from qrl.wire.connection import connect
from qrl.wire.weights import WeightStore
from tests import _envs

# how many envs a role (as made) plays (the others play none): a stepper one batch of
# envs_per_actor for each batch it keeps in flight (more the farther it is from Redis)
PLAYS = {
    "actor": lambda cfg, role: cfg.envs_per_actor,
    "stepper": lambda cfg, role: cfg.envs_per_actor * len(role.runners),
    "worker": lambda cfg, role: cfg.envs_per_worker,
}


@pytest.mark.parametrize("algo, role", [(a.name, r.name) for a in ALGOS.values() for r in a.roles])
def test_a_role_made_from_its_context_makes_only_the_envs_it_plays(
    algo, role, r, keys, redis_server
):
    """Every role of every algorithm, made as the launcher makes it (from a RoleContext with
    the run's env spec), makes no env to read spaces; one that publishes weights gives the
    evaluation policy without making one either."""
    a = ALGOS[algo]
    env_id = _envs.COUNTED_CARTPOLE if "discrete" in a.actions else _envs.COUNTED_PENDULUM
    cfg = parse_config(a.config, {"env": env_id})
    create_run(r, keys, a.name, cfg)
    before = _envs.made
    env = EnvSpec.of(env_id)
    assert _envs.made == before + 1  # the one env the launcher reads the spec from
    ctx = RoleContext(r, partial(connect, redis_server.url), keys, cfg, 0, device="cpu", env=env)
    before = _envs.made
    made = a.role(role).make(ctx)
    assert _envs.made - before == (PLAYS[role](cfg, made) if role in PLAYS else 0)
    # a learner (ES's master, a parameter server): evaluate what it publishes
    if a.weights_key(keys).removeprefix(keys.prefix) in a.role(role).access.writes:
        made.publish()
        params = WeightStore(r, keys, a.weights_key(keys)).fetch().params
        before = _envs.made
        act = a.policy(cfg, env, params)
        actions = np.asarray(act(np.zeros((3, *env.obs_shape), env.obs_dtype)))
        assert _envs.made == before and len(actions) == 3


def _in_a_thread(f: Any, *args: Any) -> Any:
    """``f(*args)`` in another thread: ``run_role`` there leaves the test process's signal
    handlers be."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(f(*args)))
    thread.start()
    thread.join(120)
    assert out, f"{f.__name__} did not return"
    return out[0]


def test_the_launcher_reads_the_spec_once_and_hands_it_to_the_role(r, keys, redis_server):
    """A role process reads the spec from one env; the role itself makes only the envs it
    plays (the run is stopped first: each role is made, then stops at once)."""
    cfg = parse_config(ALGOS["apex"].config, {"env": _envs.COUNTED_CARTPOLE})
    create_run(r, keys, "apex", cfg)
    request_stop(r, keys)
    for role, plays in (("replay", 0), ("learner", 0), ("actor", cfg.envs_per_actor)):
        spec = RoleSpec("apex", role, keys.run, redis_server.url, ident=0, limit=0, device="cpu")
        before = _envs.made
        assert _in_a_thread(run_role, spec) == 0
        assert _envs.made - before == 1 + plays, role


def test_the_spec_is_plain_read_only_data():
    pendulum = EnvSpec.of("Pendulum-v1")
    assert (pendulum.obs_shape, pendulum.obs_dtype, pendulum.action_kind) == (
        (3,),
        "float32",
        "continuous",
    )
    low, high = pendulum.box_actions()
    assert low.dtype == np.float32 and low.tolist() == [-2.0] and high.tolist() == [2.0]
    with pytest.raises(ValueError, match="read-only"):
        low[0] = 0.0
    with pytest.raises(ValueError, match="needs discrete actions"):
        pendulum.discrete_actions()
    cartpole = EnvSpec.of("CartPole-v1")
    assert cartpole.discrete_actions() == 2 and cartpole.obs_bounds[0].dtype == np.float64
    with pytest.raises(ValueError, match="Box action vector"):
        cartpole.box_actions()
    assert EnvSpec.of("FrozenLake-v1").obs_shape == ()  # Discrete observations: no bounds


@pytest.mark.parametrize(
    "obs, act, match",
    [
        (gym.spaces.Dict({"a": gym.spaces.Discrete(2)}), gym.spaces.Discrete(2), "observations"),
        (gym.spaces.Text(5), gym.spaces.Discrete(2), "observations"),
        (gym.spaces.Box(-1, 1, (2,)), gym.spaces.Discrete(3, start=1), "actions 0 .. n - 1"),
        ("not a space", gym.spaces.Discrete(2), "observations"),
    ],
)
def test_spaces_qrl_cannot_use_are_one_clear_error(obs, act, match):
    with pytest.raises(ValueError, match=f"environment 'odd-v0' has .*{match}"):
        EnvSpec.read("odd-v0", obs, act)


def test_an_env_that_cannot_be_made_is_one_clear_error():
    with pytest.raises(ValueError, match="environment 'NoSuchEnv-v0': "):
        EnvSpec.of("NoSuchEnv-v0")
