"""Observation scaling by the space's bounds, the hidden layers' activation, and a learner
that publishes before it makes its optimizer."""

import numpy as np
import pydantic
import pytest
import torch

from qrl.algos.a3c.config import A3CConfig
from qrl.algos.apex.config import ApexConfig
from qrl.algos.r2d2.config import R2D2Config
from qrl.rl.envspec import EnvSpec
from qrl.rl.models import ObsScale, policy_value_net, q_network, recurrent_q_network, torso
from qrl.runtime.runs import create_run
from qrl.wire.weights import WeightStore


def apex_net(cfg: ApexConfig) -> torch.nn.Module:
    return q_network(cfg, EnvSpec.of(cfg.env))


def scaled(net: torch.nn.Module, obs: list[float]) -> np.ndarray:
    return net.features[0](torch.tensor([obs])).numpy()[0]


def test_finite_bounds_map_to_the_unit_range_and_unbounded_dimensions_pass():
    # CartPole-v1: x in +-4.8 and the angle in +-0.418 are bounded, the velocities are not
    net = apex_net(ApexConfig())
    assert isinstance(net.features[0], ObsScale)
    out = scaled(net, [4.8, 7.0, -0.41887903, -3.0])
    np.testing.assert_allclose(out, [1.0, 7.0, -1.0, -3.0], rtol=1e-5)
    # MountainCar-v0: position -1.2..0.6 (centred at -0.3), velocity +-0.07
    car = apex_net(ApexConfig(env="MountainCar-v0"))
    np.testing.assert_allclose(scaled(car, [0.6, -0.07]), [1.0, -1.0], rtol=1e-5)
    np.testing.assert_allclose(scaled(car, [-0.3, 0.0]), [0.0, 0.0], atol=1e-6)
    # R2D2's velocity-hidden CartPole: x and the angle
    rec = recurrent_q_network(R2D2Config(), EnvSpec.of(R2D2Config().env))
    np.testing.assert_allclose(scaled(rec, [2.4, 0.2094395]), [0.5, 0.5], rtol=1e-5)


def test_huge_or_missing_bounds_and_the_option_off_leave_observations_as_they_are():
    s = ObsScale(np.array([-np.inf, -1e6, 0.0, 3.0]), np.array([np.inf, 1e6, 0.0, 3.0]))
    x = torch.tensor([[5.0, 123.0, 7.0, -2.0]])
    np.testing.assert_array_equal(s(x).numpy(), x.numpy())  # none has a sane finite range
    # Discrete observations: no bounds to scale by
    assert EnvSpec.of("FrozenLake-v1").obs_bounds is None
    plain = apex_net(ApexConfig(obs_scale=False))
    assert not isinstance(plain.features[0], ObsScale)
    raw = [4.8, 7.0, 0.4, -3.0]
    np.testing.assert_allclose(scaled(plain, raw), raw, rtol=1e-6)


def test_the_scale_travels_with_the_published_weights(r, keys):
    """Actors and evaluation load the learner's published state: the scale is in it."""
    net = apex_net(ApexConfig())
    store = WeightStore(r, keys)
    store.publish(net, version=1)
    params = store.fetch().params
    np.testing.assert_allclose(params["features.0.scale"], [1 / 4.8, 1, 1 / 0.41887903, 1])
    assert set(params) == set(net.state_dict())


def test_the_learner_publishes_its_weights_before_it_makes_its_optimizer(
    r, keys, redis_server, tmp_path
):
    """Making torch's first optimizer imports torch._dynamo (1-2 s): actors wait for the
    first weights, so they are published first. A resumed optimizer keeps its state."""
    from tests.helpers import make_learner

    cfg = ApexConfig(learning_starts=10**9)  # the sampler waits: nothing to train on
    create_run(r, keys, "apex", cfg)
    ckpt = tmp_path / "learner.pt"

    published_then: list[int] = []  # the version in Redis when each optimizer was made

    lrn = make_learner(redis_server.url, keys, cfg, checkpoint=ckpt)
    made = lrn.rule.optimizer

    def observed() -> torch.optim.Optimizer:
        published_then.append(WeightStore(r, keys).version())
        return made()

    lrn.rule.optimizer = observed
    assert lrn._opt is None and WeightStore(r, keys).version() == -1
    assert lrn.start(lambda: False)
    try:
        assert published_then == [0]  # made once, after version 0 was in Redis
        assert WeightStore(r, keys).version() == 0 and lrn._opt is not None
        for p in lrn.net.parameters():
            p.grad = torch.ones_like(p)
        lrn.opt.step()
        lrn.save()
    finally:
        lrn.source.stop()
    again = make_learner(redis_server.url, keys, cfg, checkpoint=ckpt)
    assert again._opt is None
    steps = {float(s["step"]) for s in again.opt.state_dict()["state"].values()}
    assert steps == {1.0}


def test_the_activation_setting_reaches_every_network_and_a_bad_one_is_refused():
    """A3C's tanh default (its ReLU runs needed 25k-550k env steps on CartPole-v1) is the
    config's, not a hard-coded choice: every network built from a config takes it, and its
    parameters keep their names, so the published weights' layout does not depend on it."""
    env = EnvSpec.of("CartPole-v1")
    for cfg in (ApexConfig(env="CartPole-v1", activation="tanh"), A3CConfig(env="CartPole-v1")):
        net = q_network(cfg, env) if isinstance(cfg, ApexConfig) else policy_value_net(cfg, env)
        kinds = {type(m) for m in net.modules()}
        assert torch.nn.Tanh in kinds and torch.nn.ReLU not in kinds
    relu = q_network(ApexConfig(env="CartPole-v1"), env)
    assert torch.nn.ReLU in {type(m) for m in relu.modules()}
    tanh = q_network(ApexConfig(env="CartPole-v1", activation="tanh"), env)
    assert relu.state_dict().keys() == tanh.state_dict().keys()
    with pytest.raises(pydantic.ValidationError):
        A3CConfig(env="CartPole-v1", activation="gelu")
    with pytest.raises(ValueError, match="activation 'gelu'"):
        torso((4,), (8,), activation="gelu")
