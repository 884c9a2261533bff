"""A consumer that dies by SIGKILL whenever it is handed entry seq 0 (a poison entry), and
otherwise acknowledges what it reads until the stream is empty."""

import os
import signal
import sys

import redis

from qrl.wire.keys import RunKeys
from qrl.wire.streams import StreamConsumer
from tests.helpers import ITEM

url, run = sys.argv[1], sys.argv[2]
r = redis.Redis.from_url(url)
keys = RunKeys(run)
c = StreamConsumer(r, keys, keys.experience, ITEM, consumer="poisoned", count=1, block_ms=10)
while entries := c.read():
    if entries[0].data["seq"] == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    r.rpush(keys.prefix + "test:done", entries[0].data["seq"])
    c.ack(entries)
c.close()
