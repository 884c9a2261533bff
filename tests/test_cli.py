"""The command line as a user meets it: configuration errors found before anything starts,
in one line naming the field; the Redis URL from the environment for every command."""

from __future__ import annotations

import json
import os

import pytest

from qrl.runtime.runs import load_run
from tests.cli import qrl


@pytest.mark.parametrize(
    "setting, field",
    [
        ("dueling=ture", "dueling"),  # not a boolean: no silent False
        ("hidden=", "hidden"),  # no layers
        ("lr=-1", "lr"),  # out of range
        ("gama=0.9", "gamma"),  # unknown: the closest name is suggested
    ],
)
def test_bad_settings_fail_fast_with_one_line(setting, field, tmp_path):
    out = qrl("train", "apex", "--set", setting, "--run-dir", str(tmp_path / "run"), timeout=60)
    assert out.returncode == 2  # before any role or Redis starts: no run directory (below)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0] and lines[0].startswith("Error:"), out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "args, words",
    [
        (("apex", "--env", "CartPol-v1"), ["CartPol", "Did you mean", "CartPole"]),
        (("apex", "--env", "Pendulum-v1"), ["continuous", "apex needs discrete"]),
        (("impala", "--env", "no_such_module:Foo-v0"), ["no_such_module"]),
    ],
)
def test_bad_envs_fail_fast_with_one_line(args, words, tmp_path):
    env = {**os.environ, "QRL_REDIS_URL": "redis://127.0.0.1:1/0"}
    run_dir = str(tmp_path / "run")
    for cmd in (("train", *args, "--run-dir", run_dir), ("run", "create", *args, "--run", "x")):
        out = qrl(*cmd, env=env, timeout=60)
        assert out.returncode == 2, (cmd, out.stderr)  # before Redis (port 1: none) is asked
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and all(w in lines[0] for w in words), out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "eval_env, words",
    [("Acrobot-v1", ["does not fit", "(6,)", "(4,)"]), ("Nope-v0", ["Nope", "doesn't exist"])],
)
def test_an_eval_env_that_does_not_fit_fails_fast_with_one_line(eval_env, words, tmp_path):
    env = {**os.environ, "QRL_REDIS_URL": "redis://127.0.0.1:1/0"}
    run_dir = tmp_path / "run"
    out = qrl("train", "apex", "--eval-env", eval_env, "--run-dir", str(run_dir), env=env)
    assert out.returncode == 2, out.stderr  # before Redis (port 1: none) is asked
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in ["--eval-env", *words]), out.stderr
    assert not run_dir.exists()


@pytest.mark.slow
def test_a_network_over_the_message_cap_trains(tmp_path):
    # 2 x 4200 x 4200 float32 parameters: weights over the codec's 64 MiB cap per message,
    # which once ended the job; published in chunks now (qrl/wire/chunks.py), the actors
    # load them and act (an actor steps only once it loaded published weights): the job
    # runs out its small env-step budget with no role failed (its time budget ends a job
    # whose actors never step, and env_steps shows it)
    out = qrl(
        "train",
        "apex",
        "--set",
        "hidden=4200,4200",
        "--run-dir",
        str(tmp_path / "run"),
        "--max-steps",
        "200",
        "--max-time",
        "60",
        timeout=240,
    )
    assert out.returncode == 1, out.stderr[-2000:]  # the budget ran out, nothing failed
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["failed"] == {} and result["env_steps"] > 0, result


def test_default_targets_come_from_the_registration_or_qrls_table():
    from qrl.jobs.train import default_target

    assert default_target("CartPole-v1") == 475.0  # gymnasium's reward_threshold
    assert default_target("LunarLanderContinuous-v3") == 200.0
    assert default_target("Pendulum-v1") == -200.0  # registered without one: qrl's table
    assert default_target("Acrobot-v1") == -100.0
    assert default_target("MountainCarContinuous-v0") == 90.0
    assert default_target("Nope-v0") is None


def test_a_bad_config_file_names_the_file_and_field(tmp_path):
    cfg = tmp_path / "es.toml"
    cfg.write_text("[es]\npopulation = 5\n")  # must be even
    out = qrl("train", "es", "--config", str(cfg), timeout=60)
    assert out.returncode == 2 and "population" in out.stderr


@pytest.mark.slow
def test_train_takes_the_redis_url_from_the_environment(r, redis_server, tmp_path):
    run = "env-url-train"
    out = qrl(
        "train",
        "es",
        "--run",
        run,
        "--run-dir",
        str(tmp_path / run),
        "--max-time",
        "60",
        env={"QRL_REDIS_URL": redis_server.url, "PATH": "/usr/bin:/bin"},
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    from qrl.wire.keys import RunKeys

    algo, config = load_run(r, RunKeys(run))  # the job ran in that Redis, not an embedded one
    assert algo == "es" and config["env"] == "CartPole-v1"
    result = json.loads((tmp_path / run / "result.json").read_text())
    assert result["reached"] is True
    logs = sorted((tmp_path / run / "logs").glob("*.log"))
    assert [p.name for p in logs] == ["master.log", "worker0.log", "worker1.log"]
    for path in logs:  # INFO by default: a start line with the config digest, a stop summary
        text = path.read_text()
        assert f"of run '{run}' (es on CartPole-v1, config " in text, text
        assert " started at 0 " in text and " stopped after " in text, text


@pytest.mark.slow
def test_a_rerun_of_a_run_counts_only_its_own_work(r, redis_server, tmp_path):
    # what an earlier job of the run left in its metrics (a PBT trial's last segment)
    from qrl.runtime.metrics import report
    from qrl.wire.keys import RunKeys

    run = "rerun"
    report(r, RunKeys(run), "actor", 7, steps=10**9, episode_returns=[12345.0] * 1000)
    out = qrl(
        "train",
        "ppo",
        "--redis",
        redis_server.url,
        "--run",
        run,
        "--run-dir",
        str(tmp_path / run),
        "--max-time",
        "3",
        "--target-return",
        "1e9",
        timeout=240,
    )
    assert out.returncode == 1, out.stderr[-2000:]
    result = json.loads((tmp_path / run / "result.json").read_text())
    assert 0 < result["env_steps"] < 10**9 and 0 < result["episodic_return"] <= 500, result


@pytest.mark.slow
def test_a_run_config_json_reproduces_the_run(tmp_path):
    first = tmp_path / "a"
    out = qrl(
        "train",
        "es",
        "--set",
        "population=24",
        "--run-dir",
        str(first),
        "--max-time",
        "1",
        "--target-return",
        "1e9",
        timeout=240,
    )
    assert out.returncode == 1, out.stderr[-2000:]  # budget ran out: a config.json is there
    again = tmp_path / "b"
    out = qrl(
        "train",
        "es",
        "--config",
        str(first / "config.json"),
        "--run-dir",
        str(again),
        "--max-time",
        "1",
        "--target-return",
        "1e9",
        timeout=240,
    )
    assert out.returncode == 1, out.stderr[-2000:]
    a = json.loads((first / "config.json").read_text())["config"]
    b = json.loads((again / "config.json").read_text())["config"]
    assert a == b and b["population"] == 24


@pytest.mark.slow
def test_config_show_lists_every_field_and_its_toml_round_trips(tmp_path):
    from qrl.algos import ALGOS

    for name, algo in ALGOS.items():
        out = qrl("config", "show", name, "--set", "seed=7", timeout=60)
        assert out.returncode == 0, out.stderr
        for field, info in algo.config.model_fields.items():
            assert field in out.stdout and info.description[:30] in out.stdout, field
        toml = qrl("config", "show", name, "--set", "seed=7", "--toml", timeout=60).stdout
        (tmp_path / f"{name}.toml").write_text(toml)
        again = qrl("config", "show", name, "--config", str(tmp_path / f"{name}.toml"), "--toml")
        assert again.returncode == 0 and again.stdout == toml and "seed = 7" in toml


@pytest.mark.parametrize("example", ["cartpole", "lunarlander", "pong"])
def test_the_example_configs_are_valid_for_each_algorithm_they_name(example):
    import tomllib

    from tests.cli import ROOT

    path = ROOT / "examples" / f"{example}.toml"
    algos = [k for k, v in tomllib.loads(path.read_text()).items() if isinstance(v, dict)]
    assert algos
    for algo in algos:
        out = qrl("config", "show", algo, "--config", str(path), "--toml", timeout=60)
        assert out.returncode == 0, out.stderr


@pytest.mark.slow
def test_an_env_without_a_threshold_says_so_and_runs_its_budget(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "QRL_REDIS_URL"}
    env_id = "tests._envs:QrlTestPendulum-v0"  # registered without a threshold
    out = qrl(
        "train",
        "es",
        "--env",
        env_id,
        "--max-time",
        "2",
        "--run-dir",
        str(tmp_path / "r"),
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]  # no target to reach: the budget ran, done
    assert f"{env_id} has no reward threshold" in out.stderr and "--target-return" in out.stderr
    assert json.loads((tmp_path / "r" / "result.json").read_text())["target"] is None
