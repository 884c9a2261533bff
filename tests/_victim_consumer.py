"""A consumer that acknowledges one batch, then dies by SIGKILL in the middle of the next."""

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
c = StreamConsumer(r, keys, keys.experience, ITEM, consumer="victim", count=10)
first = c.read()
c.ack(first)
r.rpush(keys.prefix + "test:victim_acked", *[e.data["seq"] for e in first])
second = c.read()
r.rpush(keys.prefix + "test:victim_inflight", *[e.data["seq"] for e in second])
os.kill(os.getpid(), signal.SIGKILL)
