"""Redis round trips off the acting path (:mod:`qrl.runtime.background`): an actor's pushes and
weights fetches, a learner's publications run on threads of their own while it acts (trains)
on; in a one-process run in line."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from qrl.algos.impala.config import ImpalaConfig
from qrl.runtime.background import RECENT, Background
from qrl.runtime.runs import create_run
from qrl.wire import clock
from qrl.wire.weights import WeightStore
from tests.helpers import make_actor, make_learner, wait_until


def test_a_job_runs_off_the_callers_thread_one_at_a_time():
    bg, threads, gate = Background("test", far_s=0), [], threading.Event()  # every job far

    def job() -> bool:
        threads.append(threading.current_thread().name)
        return gate.wait(30)  # held until the caller has gone on

    assert bg.submit(job) is None  # returns while the job waits; none ran before
    gate.set()
    assert bg.submit(lambda: 7) is True  # the first job waited for: what it returned
    assert bg.close() == 7
    assert len(threads) == 1 and threads[0].startswith("test")


def test_a_jobs_error_is_raised_to_the_caller_at_the_next_submit():
    bg = Background("test", far_s=0)

    def fails() -> bool:
        raise ValueError("refused")

    bg.submit(fails)
    with pytest.raises(ValueError, match="refused"):
        bg.submit(lambda: True)
    bg.close()


def test_on_a_seated_clock_a_job_runs_in_line():
    """A one-process run's threads read a clock of their own: no thread is started for a
    job, which runs before submit returns (the turns, and the run, stay the seed's)."""

    class Seated(clock.Clock):
        pass

    token = clock.use(Seated())
    try:
        ran = []
        assert Background("test").submit(lambda: ran.append(threading.current_thread()) or 3) == 3
        assert ran == [threading.current_thread()]
    finally:
        clock.restore(token)


def test_an_actor_fetches_new_weights_while_it_acts_and_loads_them_at_a_units_end(r, keys):
    cfg = ImpalaConfig(env="CartPole-v1", weight_poll=1)
    actor = make_actor("impala", r, keys, cfg)
    store = WeightStore(r, keys)
    net = actor.weights.net
    store.publish(net, version=1)
    assert actor.start(lambda: False) and actor.weights.version == 1
    newer = {k: np.full_like(v.numpy(), 0.5) for k, v in net.state_dict().items()}
    store.publish(newer, version=2)
    actor.weights.looking.far_s = 0  # as if Redis were far: looks on their own thread
    actor.weights.done()  # a look starts, on its own thread
    wait_until(lambda: actor.weights.looked is not None, "the look's weights")
    assert actor.weights.version == 1  # fetched, not loaded yet
    actor.weights.done()  # a unit's end: loaded
    assert actor.weights.version == 2
    assert all((p == 0.5).all() for p in net.state_dict().values())
    assert actor.weights.metrics()["weight_loads"] == 2
    actor.close(lambda: False)


def test_an_actor_does_not_wait_for_a_look_under_way(r, keys):
    """Far from Redis a look (two round trips) may outlast a unit: the units that end while
    it is under way neither wait for it nor start another; the first after it is back loads
    what it brought and looks again."""
    cfg = ImpalaConfig(env="CartPole-v1", weight_poll=1)
    actor = make_actor("impala", r, keys, cfg)
    w, store, gate, looks = actor.weights, WeightStore(r, keys), threading.Event(), []
    store.publish(w.net, version=1)
    assert actor.start(lambda: False) and w.version == 1
    w.looking.far_s = 0  # as if Redis were far: looks on their own thread
    fetch = w.store.fetch

    def held(*args, **kw):  # the look's round trips, as if they took long
        looks.append(threading.current_thread())
        gate.wait(10)
        return fetch(*args, **kw)

    w.store.fetch = held
    store.publish({k: np.full_like(v.numpy(), 0.5) for k, v in w.net.state_dict().items()}, 2)
    for _ in range(3):  # the first unit's end starts the look; the next two go on past it
        w.done()
    assert len(looks) == 1 and w.version == 1 and w.looking.busy
    gate.set()
    wait_until(lambda: not w.looking.busy, "the look's end")
    w.done()  # loaded, and the next look started
    assert w.version == 2
    wait_until(lambda: len(looks), "the next look", until=lambda n: n == 2)
    actor.close(lambda: False)


def test_a_learner_does_not_wait_for_a_publication_under_way(r, keys, redis_server):
    """Far from Redis a publication (a round trip) is about as long as an update: the
    updates that end while one is under way do not wait for it; their publication is owed,
    and made at the learner's first step after it is back, with the version of then."""
    cfg = ImpalaConfig(env="CartPole-v1")
    create_run(r, keys, "impala", cfg)
    lrn = make_learner(redis_server.url, keys, cfg)
    pub, gate, versions = lrn.publisher, threading.Event(), []
    pub.sending.far_s = 0  # as if Redis were far: publications on their own thread
    publish = pub.weights.publish

    def held(params, version):  # the publication's round trip, as if it took long
        versions.append(version)
        gate.wait(10)
        return publish(params, version)

    pub.weights.publish = held
    for lrn.updates in (1, 2, 3):  # the first starts and is held; the next two go on past it
        lrn.publish(wait=False)
    assert versions == [1] and pub.sending.busy and not pub.owes()
    gate.set()
    wait_until(lambda: not pub.sending.busy, "the publication's end")
    assert pub.owes() and lrn.step(lambda: False)  # (no batch comes: it only publishes)
    pub.close()
    assert versions == [1, 3] and pub.weights.version() == 3 and not pub.owes()


def test_quick_jobs_run_in_line_and_slow_ones_move_off_it():
    """Near Redis (most of the last jobs under ``far_s``) a job runs in the caller, a few
    slow ones among quick ones (a busy machine's) included; once most recent ones are slow
    (a round trip of a millisecond or more), off it."""
    bg, here = Background("test", far_s=0.004), threading.current_thread()
    ran = []
    for _ in range(RECENT):
        assert bg.submit(lambda: ran.append(threading.current_thread()) or 1) == 1
        assert bg.ran_in_line and ran[-1] is here
    for _ in range(RECENT // 2 - 1):  # slow now and then, as on a loaded machine
        bg.submit(lambda: threading.Event().wait(0.02))
        assert bg.ran_in_line
    for _ in range(2):  # slow jobs, as over a far link: most recent ones past far_s
        bg.submit(lambda: threading.Event().wait(0.02))
    assert not bg.ran_in_line
    bg.submit(lambda: ran.append(threading.current_thread()))
    bg.wait()
    assert ran[-1] is not here
    bg.close()
