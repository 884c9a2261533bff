"""The base of every algorithm's configuration, validated by pydantic.

One path for every source: a TOML file, ``--set KEY=VALUE`` options and the run's config in
Redis all become a dict of typed values that :func:`parse_config` validates strictly
(``dueling=ture`` is not a boolean, ``lr=-1`` is out of range, an unknown key is refused
with the closest known name). ``--set`` values are read as TOML values (``true``, ``5e-4``,
``"text"``), falling back to the raw string, so ``hidden=128,128`` and ``env=CartPole-v1``
need no quotes.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import sys
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from qrl.wire.keys import MAX_SHARDS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

C = TypeVar("C", bound="Config")


class ConfigError(ValueError):
    """A configuration value or file that cannot be used; the message is one line naming the
    field (or the file) and the problem."""


def _layers(value: Any) -> Any:
    """``"128,128"`` or ``[128, 128]`` as a tuple (``""`` is no layers, which is refused)."""
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip()]
        try:
            return tuple(int(p) for p in parts)
        except ValueError:
            return value  # reported by the validator as not a tuple of integers
    return tuple(value) if isinstance(value, list) else value


Layers = Annotated[
    tuple[Annotated[int, Field(ge=1, le=65_536)], ...],
    BeforeValidator(_layers),
    Field(min_length=1, max_length=16),
]
"""Hidden layer sizes, e.g. ``(256, 256)``; ``--set hidden=128,128``."""


LIVE: dict[str, Any] = {"live": True}
"""``json_schema_extra`` of a field that may change while its run runs (``qrl run set``,
:mod:`qrl.runtime.live`): every role that reads it applies a new value between two steps.
Fields that shape tensors, streams or processes (env, hidden, actors, unroll...) are not."""


def live_fields(cls: type[BaseModel]) -> list[str]:
    """The names of ``cls``'s fields marked :data:`LIVE`."""
    return [
        name
        for name, info in cls.model_fields.items()
        if isinstance(info.json_schema_extra, dict) and info.json_schema_extra.get("live")
    ]


def lr_field(default: float, *, le: float = 1, description: str = "Adam learning rate.") -> Any:
    """A learning rate: positive, at most ``le``, live (the learner sets it on its optimizer's
    parameter groups)."""
    return Field(default, gt=0, le=le, description=description, json_schema_extra=LIVE)


def grad_clip_field(default: float, description: str = "Gradient norm clip.") -> Any:
    """A gradient norm clip: positive, live (read at every update)."""
    return Field(default, gt=0, description=description, json_schema_extra=LIVE)


class LearningRate(BaseModel):
    """Mixin of a config whose learner steps an optimizer at ``lr`` (a subclass gives its own
    default with :func:`lr_field`)."""

    lr: float = lr_field(1e-3)


class Annealed(BaseModel):
    """Mixin of a config whose learner may anneal its learning rate (and what else its rule
    says) linearly to 0 over the run's budget, as the PPO paper does on Atari: ``qrl train``
    fills the horizon from its ``--max-steps``, else its ``--max-time``
    (:func:`with_budget`); :meth:`remaining` is the factor the schedule is at."""

    anneal: bool = Field(
        False,
        description="Anneal linearly to 0 over the run's budget: its env steps (--max-steps), "
        "else its time (--max-time).",
    )
    anneal_steps: int = Field(
        0,
        ge=0,
        description="The env steps the schedule spans (qrl train sets it from --max-steps "
        "when anneal is on; 0: not by steps).",
    )
    anneal_s: float = Field(
        0.0,
        ge=0,
        description="The seconds of training the schedule spans, counted from the learner's "
        "start (qrl train sets it from --max-time when anneal is on and no --max-steps is "
        "given; 0: not by time).",
    )

    def remaining(self, env_steps: float, seconds: float) -> float:
        """The schedule's factor, 1 falling linearly to 0, after ``env_steps`` env steps and
        ``seconds`` of training (1 with annealing off or no horizon)."""
        if not self.anneal:
            return 1.0
        done = 0.0
        if self.anneal_steps:
            done = env_steps / self.anneal_steps
        elif self.anneal_s:
            done = seconds / self.anneal_s
        return min(max(1.0 - done, 0.0), 1.0)


def with_budget(cfg: C, max_steps: int | None, max_time: float | None) -> C:
    """``cfg`` with its annealing horizon taken from a job's budget, when it anneals and has
    none of its own (any other config unchanged)."""
    if not isinstance(cfg, Annealed) or not cfg.anneal or cfg.anneal_steps or cfg.anneal_s:
        return cfg
    if max_steps:
        return cfg.model_copy(update={"anneal_steps": max_steps})
    if max_time:
        return cfg.model_copy(update={"anneal_s": float(max_time)})
    return cfg


class GradientClip(BaseModel):
    """Mixin of a config whose learner clips its gradient's norm: :class:`qrl.learners.base.Learner`
    reads ``grad_clip`` at every update."""

    grad_clip: float = grad_clip_field(10.0)


class Torso(BaseModel):
    """Mixin of a config whose network starts with qrl's torso (:func:`qrl.rl.models.torso`):
    a conv stack for images, hidden layers for vectors."""

    conv: Literal["auto", "minatar", "nature"] = Field(
        "auto",
        description="The conv stack for image observations: minatar (one 3x3 conv, 16 "
        "channels, 128 units), nature (the Nature DQN's, 512 units) or auto (minatar below "
        "36 pixels a side); vector observations go through the hidden layers instead.",
    )
    activation: Literal["relu", "tanh"] = Field(
        "relu", description="The hidden layers' activation (the conv stacks' is ReLU)."
    )


class ClaimIdle(BaseModel):
    """Mixin of a config whose roles consume a stream in a group
    (:class:`qrl.wire.streams.StreamConsumer`)."""

    claim_idle_ms: int = Field(
        30_000, ge=1, description="A dead consumer's entries are claimed after this idle time."
    )


class LearnerPool(BaseModel):
    """Mixin of a config whose learner may run as a pool of synchronous processes
    (:mod:`qrl.learners.base`: gradients averaged by torch.distributed, the pool formed
    through Redis)."""

    learners: int = Field(
        1, ge=1, le=256, description="Synchronous learner processes (gradients all-reduced)."
    )
    rendezvous_timeout: float = Field(
        120.0, gt=0, description="Seconds the learners wait for each other to form the pool."
    )


class Unrolls(LearnerPool):
    """Mixin of a config whose actors send unrolls to a pool of learners (IMPALA, PPO): the
    actors, their unrolls, and the batch the learners share (a subclass may give other
    defaults by declaring a field again)."""

    actors: int = Field(2, ge=1, le=4096, description="Actor processes.")
    envs_per_actor: int = Field(
        16, ge=1, le=4096, description="Environments per actor (unrolls per stream entry)."
    )
    unroll: int = Field(20, ge=1, le=10_000, description="Steps per unroll.")
    weight_poll: int = Field(1, ge=1, description="Unrolls between weight-version checks.")
    stream_maxlen: int = Field(
        8, ge=1, description="Stream entries waiting before actors back off."
    )
    batch_unrolls: int = Field(
        32,
        ge=1,
        le=65_536,
        description="Unrolls per update, over all learners (each takes batch_unrolls/learners).",
    )

    @model_validator(mode="after")
    def _shares(self) -> Unrolls:
        if self.batch_unrolls % self.learners:
            raise ValueError(
                f"batch_unrolls={self.batch_unrolls} must be a multiple of "
                f"learners={self.learners} (each learner takes an equal share)"
            )
        return self


class CentralInference(BaseModel):
    """Mixin of a config whose actors may leave the forward pass to inference servers (SEED
    RL, :mod:`qrl.inference`): with ``inference="central"`` the run's actors only step
    environments and the servers act for them and assemble what the learner consumes."""

    inference: Literal["local", "central"] = Field(
        "local",
        description="Where the policy acts: 'local' (each actor holds the network) or "
        "'central' (inference servers batch the actors' observations; actors need no torch).",
    )
    inference_servers: int = Field(
        1,
        ge=1,
        le=MAX_SHARDS,
        description="Inference servers with inference=central (each its own Cluster slot).",
    )
    inference_wait_ms: float = Field(
        2.0,
        ge=0,
        le=1000,
        description="How long a server waits for more of its actors' requests before it acts "
        "on a partial batch.",
        json_schema_extra=LIVE,
    )
    reply_timeout: float = Field(
        2.0, gt=0, le=600, description="Seconds an actor waits for an action before it resends."
    )
    inference_batches: int = Field(
        4,
        ge=1,
        le=16,  # protocol.MAX_BATCHES: a server pops 2 requests per batch of a list, 32 at most
        description="Env batches of envs_per_actor envs each that an actor keeps in flight "
        "with inference=central near Redis (SEED RL's actors keep several: while one "
        "batch's request is at its server, the others step); a far actor keeps more "
        "(inference_batches_per_ms). Each batch costs its envs' memory and CPU, and a longer "
        "policy lag (an unroll fills slower). R2D2's batches of one actor share its slots' "
        "epsilons.",
    )
    inference_batches_per_ms: float = Field(
        1.0,
        ge=0,
        le=16,
        description="More env batches for every whole millisecond of an actor's round trip "
        "to Redis (the median of 5 PINGs as it starts), 16 batches at most; 0 keeps "
        "inference_batches everywhere. Why: an actor steps at most its envs in flight per "
        "request's round trip (about 2 network round trips and a server batch), so far from "
        "Redis it needs more in flight to keep its rate. At a 5 ms round trip the default "
        "IMPALA run with 4 batches kept 0.41 of its loopback env steps/s, with this rule's 9 "
        "0.71-0.82, at twice the policy lag (docs/benchmarks.md, 'Many machines').",
    )


def central(cfg: CentralInference) -> bool:
    """Whether ``cfg`` runs central inference: the ``when`` of the roles that an algorithm
    whose config is :class:`CentralInference` declares for each mode."""
    return cfg.inference == "central"


class Config(BaseModel):
    """Fields every algorithm has. Subclasses add theirs with a default and a one-line
    ``description`` (shown by ``--help`` texts and docs)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    image_defaults: ClassVar[dict[str, Any]] = {}
    """Defaults that replace the fields' own when the env's observations are images
    (``C x H x W``), for the fields a config file, option or ``--set`` leaves unset: the
    commands that make a run apply them (:func:`qrl.cli.options.build_config`), so the run's
    config holds the values its roles use. PPO's paper, too, ran Atari with other settings
    than its vector tasks."""

    env: str = Field("CartPole-v1", min_length=1, description="Gymnasium environment id.")
    seed: int = Field(0, ge=0, lt=2**31, description="Random seed of every role.")
    weights_wire: Literal["native", "bfloat16"] = Field(
        "native",
        description="How the run's published weights travel: native (their own dtype) or "
        "bfloat16 (half the bytes of float32, 8 bits of mantissa; readers cast them back). "
        "A parameter server's blocks and ES's parameters stay native: the learning needs "
        "them exact.",
    )

    @property
    def wire(self) -> str | None:
        """The dtype a weight store of the run's weights sends float arrays as (None: their
        own), :attr:`weights_wire`'s."""
        return None if self.weights_wire == "native" else self.weights_wire

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        """An algorithm's image defaults are checked as its config is defined: a misspelt
        field or a bad value would otherwise surface only when an image env is trained."""
        super().__pydantic_init_subclass__(**kwargs)
        try:  # an unknown field is refused here too (extra="forbid"), with a hint
            parse_config(cls, dict(cls.image_defaults))
        except ConfigError as e:
            raise TypeError(f"{cls.__name__}.image_defaults: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (tuples as lists), as stored in Redis and checkpoints."""
        return self.model_dump(mode="json")

    def digest(self) -> str:
        """A short hash of every value: two processes with the same digest run one config."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def replace(self: C, **changes: Any) -> C:
        """A copy with ``changes``, validated like any other input."""
        return parse_config(type(self), {**self.to_dict(), **changes})


def one_line(e: ValidationError, cls: type[BaseModel]) -> str:
    """``e`` as one line naming each bad field of ``cls`` (a close name for an unknown one)."""
    problems = []
    for err in e.errors():
        name = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(name, list(cls.model_fields), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            names = ", ".join(cls.model_fields)
            problems.append(f"unknown field {name!r} ({hint}KEY one of: {names})")
        elif name:
            problems.append(f"{name}={err['input']!r}: {err['msg']}")
        else:  # a check across fields
            problems.append(err["msg"].removeprefix("Value error, "))
    return f"{cls.__name__}: " + "; ".join(problems)


def parse_config(cls: type[C], data: dict[str, Any]) -> C:
    """``cls`` from ``data``; raises :class:`ConfigError` with one line naming each bad field."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(one_line(e, cls)) from None


def parse_value(raw: str) -> Any:
    """A ``--set`` value: a TOML value if it reads as one, else the string itself."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def parse_overrides(pairs: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as a dict of typed values."""
    out = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {pair!r}: expected KEY=VALUE")
        out[key.strip()] = parse_value(raw.strip())
    return out


def read_config_file(path: Path, algo: str, algos: list[str]) -> dict[str, Any]:
    """Config fields from a TOML file (top-level keys, overridden by an ``[ALGO]`` table;
    tables of the other algorithms in ``algos`` are ignored, so one file can serve all), or
    from a run's ``config.json`` (its ``config`` object)."""
    try:
        text = path.read_text()
        if path.suffix == ".json":
            import json

            data = json.loads(text)
            return dict(data.get("config", data))
        data = tomllib.loads(text)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: {e}") from None
    unknown = [k for k, v in data.items() if isinstance(v, dict) and k not in algos]
    if unknown:
        raise ConfigError(
            f"{path}: unexpected tables {unknown} (fields go at the top level or in an "
            f"[{'|'.join(sorted(algos))}] table)"
        )
    values = {k: v for k, v in data.items() if not isinstance(v, dict)}
    values.update(data.get(algo, {}))
    return values
