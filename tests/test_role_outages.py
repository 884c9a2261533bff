"""What one role's user writes into a stream or a counter ends no other role (issue 68,
findings 2, 3 and 8): a stream whose ids someone used up is started afresh, a counter at
the int64 edge is reset with commands an actor's user has, a refused (NOPERM) or BUSY
reply is waited out, and the metrics reader never fetches an entry larger than a report.
Real redis-servers (Redis 7 for the per-role ACL users), real ``qrl`` roles."""

from __future__ import annotations

import logging
import threading

import redis

from qrl.server.embedded import EmbeddedRedis
from qrl.wire.connection import connect
from tests.helpers import wait_until


def test_a_busy_redis_is_waited_out_like_a_lost_one(tmp_path, caplog):
    with EmbeddedRedis() as server:
        admin = redis.Redis.from_url(server.url)
        admin.config_set("lua-time-limit", 50)  # BUSY after 50 ms (Redis 7: busy-reply-threshold)
        busy = "local t = redis.call('TIME')[1] while redis.call('TIME')[1] - t < 3 do end"
        loop = threading.Thread(target=lambda: redis.Redis.from_url(server.url).eval(busy, 0))
        client = connect(server.url)
        loop.start()
        try:

            def answers_busy() -> bool:
                try:
                    admin.ping()
                except redis.ResponseError as e:
                    return str(e).startswith("BUSY")
                return False

            wait_until(answers_busy, "Redis busy with the script", 10, every=0.02)
            with caplog.at_level(logging.WARNING):
                assert client.set("k", 1)  # waited for the script to end
        finally:
            loop.join(10)
        assert any("busy running a script" in m for m in caplog.messages), caplog.messages
