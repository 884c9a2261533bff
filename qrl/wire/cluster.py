"""qrl's client for a Redis Cluster: redis-py's :class:`~redis.cluster.RedisCluster` with
qrl's retry policy.

:func:`qrl.wire.connection.connect` gives one of these when the node its URL names says
it is in cluster mode (``CLUSTER INFO`` answers; a node not in cluster mode refuses it,
and unlike ``INFO`` it is allowed to an ACL user without ``@dangerous``): a URL of any node reaches
the whole cluster, no other scheme or setting is needed. Every key of a run carries the hash
tag ``{RUN}``, so a run's keys, and with them every multi-key command, transaction and Lua
script of qrl, stay in one slot of one node; SCAN (``qrl run list``, ``qrl run delete``,
``qrl status``) walks every master (redis-py's cluster ``scan_iter``).

redis-py's cluster client retries a failed command a fixed number of times, at once, with no
backoff and no deadline. Here it makes one attempt (which follows MOVED/ASK redirects and
refreshes the slot map on a lost node), and the whole command, or the whole pipeline, is
retried under the same :class:`qrl.wire.connection.DeadlineBackoff` policy as on a single node:
backoff up to 2 s apart until ``QRL_REDIS_DEADLINE``, then ``RedisUnavailable``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from redis.backoff import NoBackoff
from redis.cluster import ClusterPipeline, RedisCluster
from redis.exceptions import (
    ClusterDownError,
    NoScriptError,
    RedisClusterException,
    SlotNotCoveredError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

_LOST = (RedisConnectionError, RedisTimeoutError, OSError)
# what a lost node or slot raises: worth waiting out (RedisClusterException only when a lost
# connection caused it, e.g. no node answering while the slot map is refreshed)
RETRY_ON = (*_LOST, ClusterDownError, SlotNotCoveredError, RedisClusterException)


def _lost(error: BaseException) -> bool:
    if isinstance(error, RedisClusterException):
        return isinstance(error.__cause__, _LOST)
    return True


def _ignore(_error: BaseException) -> None:
    pass


class ClusterClient(RedisCluster):
    """A :class:`RedisCluster` whose commands and pipelines are retried by ``retry`` (a
    ``Retry`` over :data:`RETRY_ON`). Built by :func:`qrl.wire.connection.connect`."""

    def __init__(self, url: str, *, retry: Retry, **kwargs: Any) -> None:
        self._deadline_retry = retry  # before RedisCluster's own set-up sends commands
        super().__init__(url=url, retry=Retry(NoBackoff(), 0), **kwargs)

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        run = super().execute_command
        return self._deadline_retry.call_with_retry(
            lambda: run(*args, **kwargs), _ignore, is_retryable=_lost
        )

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> ClusterPipeline:
        pipe = super().pipeline(transaction, shard_hint)
        pipe.execute = partial(_execute, pipe, self._deadline_retry)  # type: ignore[method-assign]
        return pipe

    def disconnect(self) -> None:
        """Close every open connection (a forked child opens its own)."""
        self.disconnect_connection_pools()


def _execute(pipe: ClusterPipeline, retry: Retry, raise_on_error: bool = True) -> list[Any]:
    """``pipe.execute()``, retried whole: each attempt queues the same commands again (a
    failed attempt leaves the pipeline reset)."""
    strategy = pipe._execution_strategy  # redis-py keeps the queued commands there
    queued = [(c.args, dict(c.options)) for c in strategy.command_queue]

    def attempt() -> list[Any]:
        pipe.reset()
        for args, options in queued:
            pipe.pipeline_execute_command(*args, **options)
        return ClusterPipeline.execute(pipe, raise_on_error)

    return retry.call_with_retry(attempt, _ignore, is_retryable=_lost)


def run_scripts(
    client: Any, calls: list[tuple[Any, list[str], list[Any]]], *, errors: bool = False
) -> list[Any]:
    """Each ``(script, keys, args)`` of ``calls`` (a :class:`qrl.wire.scripts.Bound`) run
    in one pipeline: one round trip to a node, or to each node of a cluster at once. A
    pipeline loads no scripts, so each goes as EVALSHA, and one that a node does not hold
    yet (NOSCRIPT: new, or a node that restarted or failed over) runs again on its own,
    which loads it or waits for the admin to (:mod:`qrl.wire.scripts`).
    Returns the replies in order; raises the first error any other call met (with
    ``errors``: returns it in that call's place, for the caller to judge each)."""
    pipe = client.pipeline(transaction=False)
    for script, keys, args in calls:
        script.queue(pipe, keys, args)
    out = []
    for (script, keys, args), reply in zip(calls, pipe.execute(raise_on_error=False), strict=True):
        if isinstance(reply, NoScriptError):
            reply = script(keys=keys, args=args)
        elif isinstance(reply, Exception):
            script.refused(reply)  # says which script, if the user may not run it
            if not errors:
                raise reply
        out.append(reply)
    return out
