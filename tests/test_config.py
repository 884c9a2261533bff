import pytest
import redis

from qrl.runtime.config import Config, Layers, parse_config
from qrl.runtime.runs import RunExists, RunNotFound, create_run, load_run_config
from qrl.wire.codec import CodecError
from qrl.wire.keys import RunKeys


class Cfg(Config):
    lr: float = 1e-3
    n_step: int = 3
    hidden: Layers = (64, 64)
    device: str | None = None


def test_role_joins_with_url_and_run_name_only(r, keys, redis_server):
    cfg = Cfg(lr=5e-4, hidden=(32,))
    assert create_run(r, keys, "apex", cfg) is True
    # another process knows only the URL and the run name
    joined = redis.Redis.from_url(redis_server.url)
    assert load_run_config(joined, RunKeys(keys.run), "apex", Cfg) == cfg


def test_create_is_once(r, keys):
    assert create_run(r, keys, "apex", Cfg()) is True
    assert create_run(r, keys, "apex", Cfg()) is False  # identical: joining is fine
    with pytest.raises(RunExists, match="lr"):
        create_run(r, keys, "apex", Cfg(lr=1.0))
    with pytest.raises(RunExists):
        create_run(r, keys, "impala", Cfg())
    with pytest.raises(CodecError, match="apex run, not impala"):
        load_run_config(r, keys, "impala", Cfg)


def test_missing_run(r, keys):
    with pytest.raises(RunNotFound, match=keys.run):
        load_run_config(r, keys, "apex", Cfg)


def test_parse_config_checks_types():
    assert parse_config(Cfg, {"lr": 1, "hidden": [8, 8]}) == Cfg(lr=1.0, hidden=(8, 8))
    for bad in ({"lr": "x"}, {"n_step": 2.5}, {"n_step": True}, {"hidden": ["a"]}, {"zz": 1}):
        with pytest.raises(ValueError):
            parse_config(Cfg, bad)


def test_run_names_are_checked():
    RunKeys("ok-name_1.2")
    for bad in ("", "a b", "x}y", "a" * 65, "-x", "a:b"):
        with pytest.raises(ValueError):
            RunKeys(bad)
    assert RunKeys("r1").experience == "qrl:{r1}:experience"
    keys = RunKeys("r1")
    names = [getattr(keys, p) for p in dir(RunKeys) if isinstance(getattr(RunKeys, p), property)]
    assert all(n.startswith("qrl:{r1}:") for n in names) and len(set(names)) == len(names)


def test_checkpoints_refuse_pickled_objects_and_other_formats(tmp_path):
    import torch

    from qrl.algos.es.config import ESConfig
    from qrl.runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    good = tmp_path / "good.pt"
    save_checkpoint(good, "es", ESConfig(), {"theta": torch.zeros(3)}, None, 7)
    assert load_checkpoint(good, "es", ESConfig())["step"] == 7

    # a pickled object that would run code when loaded (here only print) is refused
    evil = tmp_path / "evil.pt"
    state = torch.load(good, weights_only=True)
    torch.save({**state, "extra": _RunsCode()}, evil)
    with pytest.raises(CheckpointError, match="cannot load"):
        load_checkpoint(evil, "es")

    old = tmp_path / "old.pt"
    torch.save({**state, "format": 0, "qrl_version": "0.0.1"}, old)
    with pytest.raises(CheckpointError, match=r"format 0 \(written by qrl 0.0.1\)"):
        load_checkpoint(old, "es")


class _RunsCode:
    def __reduce__(self):
        return (print, ("this ran while loading a checkpoint",))


def test_replace_model_keeps_the_reaching_weights_and_the_rest(tmp_path):
    import numpy as np
    import torch

    from qrl.algos.impala.config import ImpalaConfig
    from qrl.runtime.checkpoint import (
        CheckpointError,
        load_checkpoint,
        replace_model,
        save_checkpoint,
    )

    net, other = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(net.parameters())
    path = tmp_path / "c.pt"
    save_checkpoint(path, "impala", ImpalaConfig(), net, opt, 91)
    params = {k: v.detach().numpy() for k, v in other.state_dict().items()}
    replace_model(path, params, 50)
    state = load_checkpoint(path, "impala", ImpalaConfig())
    assert state["step"] == 50 and state["optimizer"]["param_groups"]
    for k, v in params.items():
        np.testing.assert_array_equal(state["model"][k].numpy(), v)
    with pytest.raises(CheckpointError, match="do not match"):
        replace_model(path, {"weight": params["weight"]}, 60)
    assert load_checkpoint(path)["step"] == 50  # a refused swap changes nothing
