"""Image observations: MinAtar's games as qrl makes them (channels first, bool, a time
limit), and the conv networks chosen from the observation's shape for every algorithm that
acts on images (MinAtar's small images, the Nature DQN's 84x84 frames)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from qrl.algos import ALGOS
from qrl.algos.a3c.config import A3CConfig
from qrl.algos.apex.config import ApexConfig
from qrl.algos.impala.config import ImpalaConfig
from qrl.algos.ppo.config import PPOConfig
from qrl.algos.r2d2.config import R2D2Config
from qrl.cli.options import build_config
from qrl.rl.envs import MINATAR_STEPS, make_env
from qrl.rl.envspec import EnvSpec
from qrl.rl.models import policy_value_net, q_network, recurrent_q_network
from tests.cli import qrl, train

GAMES = {  # MinAtar's channels and minimal action sets (Young & Tian 2019)
    "Breakout": (4, 3),
    "SpaceInvaders": (6, 4),
    "Asterix": (4, 5),
    "Freeway": (7, 3),
    "Seaquest": (10, 6),
}
ATARI = EnvSpec.read(  # the shape and dtype of qrl's Atari frames, without the emulator
    "ALE/Pong-v5", gym.spaces.Box(0, 255, (4, 84, 84), np.uint8), gym.spaces.Discrete(6)
)


@pytest.mark.parametrize("game", GAMES)
def test_minatar_games_come_channels_first_as_bools_with_a_time_limit(game):
    channels, actions = GAMES[game]
    spec = EnvSpec.of(f"MinAtar/{game}-v1")  # registered by qrl, not by the user
    assert (spec.obs_shape, spec.obs_dtype, spec.n_actions) == ((channels, 10, 10), "bool", actions)
    env = make_env(f"MinAtar/{game}-v1", seed=3)
    try:
        obs, _ = env.reset(seed=3)
        raw = env.unwrapped.game.state()  # (10, 10, C), as MinAtar keeps it
        np.testing.assert_array_equal(obs, np.moveaxis(raw, -1, 0))
        assert obs.dtype == bool and env.observation_space.contains(obs)
        assert env.spec.max_episode_steps == MINATAR_STEPS
    finally:
        env.close()


def _out(net: torch.nn.Module, spec: EnvSpec, batch: int = 5) -> torch.Tensor:
    obs = torch.from_numpy(np.ones((batch, *spec.obs_shape), spec.obs_dtype))
    out = net(obs)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("algo", ["apex", "impala", "ppo", "a3c"])
def test_the_network_is_minatars_for_small_images_and_natures_for_84x84(algo):
    cfg = {"apex": ApexConfig, "impala": ImpalaConfig, "ppo": PPOConfig, "a3c": A3CConfig}[algo]()
    make = q_network if algo == "apex" else policy_value_net
    minatar = EnvSpec.of("MinAtar/SpaceInvaders-v1")
    net = make(cfg, minatar)
    convs = [m for m in net.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size, c.stride) for c in convs] == [
        (6, 16, (3, 3), (1, 1))
    ]
    assert [m.out_features for m in net.features if isinstance(m, torch.nn.Linear)] == [128]
    assert net.features[1](torch.zeros(1, 6, 10, 10)).shape == (1, 16 * 8 * 8)
    assert _out(net, minatar).shape == (5, 4)
    atari = make(cfg, ATARI)
    convs = [m for m in atari.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [(c.out_channels, c.kernel_size[0], c.stride[0]) for c in convs] == [
        (32, 8, 4),
        (64, 4, 2),
        (64, 3, 1),
    ]
    assert [m.out_features for m in atari.features if isinstance(m, torch.nn.Linear)] == [512]
    assert _out(atari, ATARI, 2).shape == (2, 6)


def test_r2d2s_recurrent_network_takes_sequences_of_images():
    spec = EnvSpec.of("MinAtar/Breakout-v1")
    net = recurrent_q_network(R2D2Config(env="MinAtar/Breakout-v1"), spec)
    q, (h, c) = net(torch.ones(3, 7, *spec.obs_shape, dtype=torch.bool))
    assert q.shape == (3, 7, 3) and h.shape == c.shape == (3, net.lstm_size)


def test_images_are_divided_by_their_largest_value():
    """Atari's uint8 frames by 255, MinAtar's bools by 1: the first layer sees 0..1."""
    for spec, scale in ((ATARI, 1 / 255), (EnvSpec.of("MinAtar/Breakout-v1"), 1.0)):
        net = q_network(ApexConfig(), spec)
        assert net.features[0].scale == pytest.approx(scale)


def test_conv_is_a_setting_and_a_stack_that_cannot_fit_is_refused_clearly():
    spec = EnvSpec.of("MinAtar/Breakout-v1")
    with pytest.raises(ValueError, match="too small for the Nature CNN"):
        q_network(ApexConfig(conv="nature"), spec)
    net = q_network(ApexConfig(conv="minatar"), ATARI)  # small stack on big frames: allowed
    assert _out(net, ATARI, 2).shape == (2, 6)
    with pytest.raises(ValueError, match="conv"):
        ApexConfig(conv="resnet")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["apex", "impala", "ppo"])
def test_image_observations_take_the_configs_image_defaults(name):
    algo = ALGOS[name]
    images = algo.config.image_defaults
    cfg = build_config(algo, None, (), env="MinAtar/Breakout-v1")
    assert images and {k: getattr(cfg, k) for k in images} == images
    assert build_config(algo, None, (), env="CartPole-v1") == algo.config()  # vectors: its own


@pytest.mark.slow
def test_an_image_envs_defaults_are_shown_and_yield_to_what_is_given():
    ppo, images = ALGOS["ppo"], PPOConfig.image_defaults
    given = build_config(ppo, None, ("lr=1e-3",), env="MinAtar/Breakout-v1")
    assert given.lr == 1e-3 and given.epochs == images["epochs"]  # what is given stays
    shown = qrl("config", "show", "ppo", "--env", "MinAtar/Breakout-v1", "--toml", timeout=60)
    assert f"epochs = {images['epochs']}" in shown.stdout
    table = qrl("config", "show", "ppo", "--env", "MinAtar/Breakout-v1", timeout=60).stdout
    row = next(line for line in table.splitlines() if line.split()[:1] == ["lr"])
    assert row.split()[1:3] == ["0.00025", "(live)"]  # an image env's own default: unmarked


def test_image_defaults_are_checked_as_a_config_is_defined():
    with pytest.raises(TypeError, match="unknown field 'lrr'"):

        class Misspelt(PPOConfig):
            image_defaults = {"lrr": 1e-3}

    with pytest.raises(TypeError, match="lr"):

        class Negative(PPOConfig):
            image_defaults = {"lr": -1.0}


RANDOM_BREAKOUT = 0.41  # a uniform random policy's mean over 200 episodes (seeds 0-199)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("algo", ["apex", "r2d2", "impala", "ppo"])
def test_a_short_minatar_run_beats_the_random_policy(algo, tmp_path):
    """With the defaults, from the CLI: 2.0 on Breakout (five times the random policy's
    return), confirmed on 100 fresh episodes, within two minutes."""
    result = train(
        algo,
        tmp_path / "run",
        "--env",
        "MinAtar/Breakout-v1",
        "--seed",
        "0",
        "--target-return",
        "2",
        "--max-time",
        "120",
        timeout=360,
    )
    assert result["reached"] and result["confirm_return"] >= 2.0 > 4 * RANDOM_BREAKOUT
