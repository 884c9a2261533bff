"""The learner group of a run: N learners averaging their gradients every update (DD-PPO
style) in a torch.distributed process group formed through Redis alone (the run's keys and N;
no env vars). ``learners:gen`` names the forming generation, ``learners:joined:GEN`` counts its
members (rank = count - 1); a full generation (a pool restarted after a crash never joins its
dead predecessor), one of another size or garbage is not joined: a new one starts. Once it is
full, ``init_process_group`` (NCCL on CUDA, else gloo) rendezvous through
:class:`RedisStore`, the hash ``learners:store:GEN``: torch's own ``TCPStore`` would serve
rank 0's port to anyone who reaches it, without authentication (any party could set and get
its keys and so steer or stall the group's forming); the run's keys are reachable only by
whoever Redis lets in, and with per-role users (``qrl run create --acl``) only the learners'
user reaches ``learners:*``. So there is no rendezvous port. What stays on the network is
gloo's (or NCCL's) own connections between the ranks: each learner listens on a port the OS
picks on its address (``host=``, default the interface that reaches Redis) and the others
connect; those carry the gradients, unauthenticated, so keep the learners on one private
network or firewall those ports to the learners' hosts. The keys expire ``timeout_s`` after
the last write; a learner that gives up before its generation is full deletes it. Nothing
from Redis is unpickled, no collective here pickles.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import ipaddress
import logging
import math
import os
import re
import secrets
import socket
import time
from collections.abc import Callable, Iterable, Sequence

import redis
import torch
import torch.distributed as dist

from qrl.wire.keys import RunKeys
from qrl.wire.scripts import Lua

log = logging.getLogger(__name__)

_POLL = 0.05  # seconds between looks at Redis while the group forms
_MAX_VALUE = 1 << 20  # bytes a store value may have (gloo's addresses, NCCL's id: < 1 KiB)
_PORT = re.compile(r"[0-9]{1,5}")
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"{_LABEL}(\.{_LABEL})*")

# the pool's rendezvous (qrl/wire/lua/group.*.lua, each after group.current's checks of what
# the keys hold): a learner looks at the forming generation and joins it (_enter), and one
# that gives up before it is full abandons it (LearnerGroup.join)
JOIN = Lua("group.join", "group.current", "group.join")
LOOK = Lua("group.look", "group.current", "group.look")
ABANDON = Lua("group.abandon", "group.current", "group.abandon")


class GroupLost(RuntimeError):
    """A member of the learner group is gone (its collective failed or timed out): restart the
    learners, they resume from the checkpoint."""


def _key(keys: RunKeys, what: str, gen: str = "") -> str:
    return keys.key(f"learners:{what}:{gen}" if gen else f"learners:{what}")


def check_address(text: str, what: str = "address") -> tuple[str, int]:
    """``(host, port)`` of ``host:port`` (an IP address, ``[v6]`` too, or a host name)."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host[:1] == "[" and host[-1:] == "]" else host
    try:
        host = str(ipaddress.ip_address(host))
    except ValueError:
        host = host if len(host) <= 253 and _HOSTNAME.fullmatch(host) else ""
    if not host or not sep or not _PORT.fullmatch(port) or not 0 < int(port) < 65536:
        raise ValueError(f"{what} {text[:80]!r} is not host:port with a port in 1-65535")
    return host, int(port)


def local_host(client, keys: RunKeys) -> str:
    """This machine's address on the interface that reaches Redis (so likely the other learners
    too): a UDP socket's after connecting it (which sends nothing); 127.0.0.1 for a unix socket."""
    if hasattr(client, "get_node_from_key"):  # a cluster client: the node of the run's keys
        node = client.get_node_from_key(_key(keys, "gen"))
        rhost, rport = node.host, node.port
    else:
        kwargs = client.connection_pool.connection_kwargs
        rhost, rport = kwargs.get("host"), kwargs.get("port", 6379)
    if not rhost:
        return "127.0.0.1"
    family, _, _, _, sockaddr = socket.getaddrinfo(rhost, rport, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return s.getsockname()[0]


def _enter(client, keys: RunKeys, world: int, ttl: int) -> tuple[str, int]:
    """Join the forming generation (or start one): ``(gen, rank)``."""
    join, look = JOIN.on(client), LOOK.on(client)
    for _ in range(100):  # another learner joined between look and join: look again
        seen = look(keys=[_key(keys, "gen")], args=["", "", world])
        seen = seen.decode() if isinstance(seen, bytes) else ""
        new = f"{secrets.token_hex(8)}.{world}"
        names = [_key(keys, "gen"), _key(keys, "joined", seen or new), _key(keys, "joined", new)]
        gen, n = join(keys=names, args=[seen, new, world, ttl])
        if n:
            return gen.decode(), int(n) - 1
    raise RuntimeError(f"could not join the learner group of run {keys.run}: it keeps changing")


def _wait(client, keys, gen, world, deadline, should_stop, timeout_s) -> bool:
    """Wait until ``gen`` is full: True, or False if ``should_stop()``."""
    count = _key(keys, "joined", gen)
    while not should_stop():
        try:
            raw = client.getrange(count, 0, 8)
        except redis.ResponseError:  # WRONGTYPE: overwritten, so gone
            raw = b""
        n = int(raw) if raw.isdigit() and len(raw) <= 6 else 0
        if not 0 < n <= world:
            raise RuntimeError(
                f"the learner group of run {keys.run} was abandoned while it "
                "formed (a learner gave up?): restart the learners"
            )
        if n == world:
            return True
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"the learner group of run {keys.run} did not form within {timeout_s:g} s: "
                f"{n} of {world} learners joined; start the other {world - n} (the same "
                f"command, the same number of learners) within {timeout_s:g} s of it"
            )
        time.sleep(_POLL)
    return False


class _Stopped(Exception):
    """Told to stop while waiting for the group's rendezvous."""


class RedisStore(dist.Store):
    """torch.distributed's rendezvous store as one hash of the run (``learners:store:GEN``):
    what torch's init asks of a store (set, get, add, check, wait, delete, count), each write
    renewing the hash's expiry. Only the learners write ``learners:*``; a value over
    ``_MAX_VALUE`` bytes or of another type is an error, never read whole. A wait ends with
    :class:`_Stopped` once ``should_stop()`` turns true (a learner told to stop while a peer
    that entered the group never came)."""

    def __init__(
        self,
        client,
        key: str,
        ttl: int,
        timeout_s: float,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        super().__init__()
        self.client, self.key, self.ttl, self.timeout_s = client, key, ttl, timeout_s
        self.should_stop = should_stop

    def _write(self, command: str, *args):
        pipe = self.client.pipeline(transaction=False)
        pipe.execute_command(command, self.key, *args)
        pipe.expire(self.key, self.ttl)
        return pipe.execute()[0]

    def set(self, key: str, value) -> None:
        self._write("HSET", key, bytes(value) if not isinstance(value, str) else value)

    def add(self, key: str, amount: int) -> int:
        return int(self._write("HINCRBY", key, amount))

    def get(self, key: str) -> bytes:
        self.wait([key])
        if self.client.hstrlen(self.key, key) <= _MAX_VALUE:
            value = self.client.hget(self.key, key)
            if value is not None and len(value) <= _MAX_VALUE:
                return value
        raise RuntimeError(
            f"{self.key} holds no store value of {key!r} (over {_MAX_VALUE} "
            "bytes, or gone): restart the learners"
        )

    def check(self, keys: list[str]) -> bool:
        return all(self.client.hexists(self.key, k) for k in keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        seconds = timeout.total_seconds() if timeout else self.timeout_s
        deadline = time.monotonic() + seconds
        while not self.check(keys):
            if self.should_stop():
                raise _Stopped
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"the learner group's store {self.key}: {keys} not set "
                    f"within {seconds:g} s (a learner is gone?)"
                )
            time.sleep(_POLL / 5)

    def delete_key(self, key: str) -> bool:
        return bool(self.client.hdel(self.key, key))

    def num_keys(self) -> int:
        return int(self.client.hlen(self.key))


def interface_of(host: str) -> str:
    """The name of this machine's network interface that has the address ``host`` (a name is
    resolved first). gloo, and NCCL's sockets, bind the interface their documented variables
    ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` name; left to themselves they bind what
    the machine's host name resolves to, often 127.0.1.1 or an interface the other learners
    do not reach."""
    import psutil

    wanted = {ipaddress.ip_address(info[4][0]) for info in socket.getaddrinfo(host, None)}
    for name, addresses in psutil.net_if_addrs().items():
        for a in addresses:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                with contextlib.suppress(ValueError):
                    if ipaddress.ip_address(a.address.split("%")[0]) in wanted:
                        return name
    raise ValueError(f"no network interface of this machine has the address {host}")


class LearnerGroup:
    """This learner's place in the group: ``rank`` of ``world``. Made by :meth:`join`."""

    def __init__(self, rank: int, world: int, device: torch.device, store=None) -> None:
        self.rank, self.world, self.device = rank, world, device
        self._store = store  # NCCL reads it at its first collective: kept as long as the group
        self._closed = world == 1

    @property
    def leader(self) -> bool:
        """Rank 0: the one that publishes weights and writes checkpoints."""
        return self.rank == 0

    @classmethod
    def join(
        cls,
        client,
        keys: RunKeys,
        world: int,
        device: torch.device,
        *,
        timeout_s: float = 60.0,
        should_stop: Callable[[], bool] = lambda: False,
        host: str | None = None,
        collective_timeout_s: float = 300.0,
    ) -> LearnerGroup | None:
        """Join the run's group of ``world`` learners (world 1: alone, no torch.distributed).
        None if ``should_stop()`` turned true while waiting; TimeoutError if the group did not
        form within ``timeout_s``. ``host``: this learner's address for the others (default
        :func:`local_host`). A collective that waits ``collective_timeout_s`` raises
        :class:`GroupLost`."""
        if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= 65536:
            raise ValueError(f"world must be a whole number of learners >= 1, not {world!r}")
        device = torch.device(device)
        if world == 1:
            return cls(0, 1, device)
        if dist.is_initialized():
            raise RuntimeError("this process is in a torch.distributed group already")
        # imported once a group exists (by an optimizer), torch._dynamo pins it: SIGABRT at exit
        import torch._dynamo as _dynamo  # noqa: F401

        host = check_address(f"{host}:1", "host=")[0] if host else local_host(client, keys)
        deadline, ttl = time.monotonic() + timeout_s, max(1, math.ceil(timeout_s))
        gen, rank = _enter(client, keys, world, ttl)
        log.info("learner group of run %s: rank %d of %d (gen %s)", keys.run, rank, world, gen)
        formed = False
        try:
            if not _wait(client, keys, gen, world, deadline, should_stop, timeout_s):
                return None
            store = RedisStore(
                client, _key(keys, "store", gen), ttl, max(timeout_s, 5.0), should_stop
            )
            if device.type == "cuda":
                torch.cuda.set_device(device)
            # this process's own environment (a learner is a process of its own): the group
            # binds the interface of the address the others were told
            os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = interface_of(host)
            dist.init_process_group(
                "nccl" if device.type == "cuda" else "gloo",
                store=store,
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=collective_timeout_s),
            )
            formed = True
            return cls(rank, world, device, store)
        except _Stopped:
            return None
        finally:
            if not formed:  # stopped, timed out or failed: nobody may wait for this one
                names = [_key(keys, "gen"), _key(keys, "joined", gen), _key(keys, "store", gen)]
                with contextlib.suppress(redis.RedisError):
                    ABANDON(client, names, ["", "", world])

    def _do(self, what: str, fn: Callable, *args) -> None:
        """``fn(*args)``, a collective: its failure (a peer gone, a timeout) is GroupLost."""
        if self._closed:
            raise RuntimeError("the learner group is closed")
        try:
            fn(*args)
        except RuntimeError as e:  # DistBackendError included
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise GroupLost(
                f"learner rank {self.rank} of {self.world}: the group's {what} failed "
                f"({first[:300]}): a learner of the group is gone; restart the "
                "learners, they resume from the checkpoint"
            ) from e

    @staticmethod
    def grads(params: Iterable[torch.nn.Parameter]) -> list[torch.Tensor]:
        """The parameters' gradients, zeros (set) where one has none: the same layout on all."""
        params = list(params)
        for p in params:
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        return [p.grad for p in params]

    def all_reduce_mean_(self, tensors: Sequence[torch.Tensor]) -> float:
        """Average ``tensors`` in place across the ranks (one collective on one flat buffer);
        the seconds it took. Gradients: pass :meth:`grads` ``(params)``."""
        if any(t is None for t in tensors):
            raise TypeError("a tensor is None: pass group.grads(params) (zeros for no grad)")
        if self.world == 1 or not tensors:
            return 0.0
        start = time.perf_counter()
        flat = torch.cat([t.detach().reshape(-1).to(self.device) for t in tensors])
        self._do("all_reduce", dist.all_reduce, flat)
        _unflatten(flat.div_(self.world), tensors)
        if self.device.type == "cuda":  # the copies are queued: wait for a true time
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """The sum of ``values`` over the ranks (a new tensor; a small one: statistics)."""
        if self.world == 1:
            return values
        buf = values.detach().to(self.device, copy=True)
        self._do("sum", dist.all_reduce, buf)
        return buf.to(values.device)

    def any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any (a vote to stop)."""
        return bool(self.sum(torch.tensor([float(bool(flag))]))[0] > 0)

    def _from_each(self, *values: int) -> torch.Tensor:
        """Every rank's ``values`` (int64): a row per rank, in rank order."""
        mine = torch.zeros(self.world, len(values), dtype=torch.int64)
        mine[self.rank] = torch.tensor(values, dtype=torch.int64)
        return self.sum(mine)

    def _agree(self, what: str, signs: torch.Tensor, src: int) -> None:
        if not bool((signs == signs[src]).all()):  # a broadcast of other sizes would hang
            raise RuntimeError(
                f"learner rank {self.rank}: the learners' {what} differ "
                f"({signs.tolist()}): start all with the same config"
            )

    def _broadcast(self, tensors: list[torch.Tensor], src: int) -> None:
        """Copy rank ``src``'s ``tensors`` into every rank's: one broadcast per dtype."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1).to(self.device) for t in group])
            self._do("broadcast", dist.broadcast, flat, src)
            if self.rank != src:
                _unflatten(flat, group)

    def sync(self, net: torch.nn.Module, opt: torch.optim.Optimizer, updates: int) -> int:
        """Give every rank the state of the rank with the most ``updates`` (the lowest such
        rank): the net's parameters and buffers, the optimizer's state. Returns its count."""
        if self.world == 1:
            return updates
        params = [p for g in opt.param_groups for p in g["params"]]
        counts = self._from_each(int(updates), _digest([*net.state_dict().values(), *params]))
        src = int(torch.argmax(counts[:, 0]))  # the first of equal maxima: the lowest rank
        self._agree("networks", counts[:, 1], src)
        has = torch.tensor([bool(opt.state.get(p)) for p in params], dtype=torch.uint8)
        self._broadcast([has], src)
        if self.rank != src:
            _match_state(opt, params, has.tolist())
        tensors = list(net.state_dict().values())
        for p in params:  # the optimizer's state tensors (Adam: step, exp_avg, exp_avg_sq)
            state = opt.state.get(p, {})
            tensors += [state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor)]
        self._agree("optimizers", self._from_each(_digest(tensors))[:, 0], src)
        self._broadcast(tensors, src)
        log.info("learner group synced from rank %d (%d updates)", src, int(counts[src, 0]))
        return int(counts[src, 0])

    def close(self) -> None:
        """Leave the group (destroy the process group); idempotent."""
        if not self._closed:
            self._closed = True
            if dist.is_initialized():
                dist.destroy_process_group()
            self._store = None


def _digest(tensors: list[torch.Tensor]) -> int:
    """A signature of the tensors' dtypes and shapes (7 bytes: an int64 that sums safely)."""
    text = repr([(t.dtype, tuple(t.shape)) for t in tensors]).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:7], "big")


def _unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for t, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
            t.copy_(part.view(t.shape))


def _match_state(opt: torch.optim.Optimizer, params: list, has: list[int]) -> None:
    """Give ``opt`` state (made by a step on zero gradients, the parameters put back after)
    where the source has state, none elsewhere: the source's tensors to broadcast into."""
    for p, h in zip(params, has, strict=True):
        if not h:
            opt.state.pop(p, None)
    missing = {id(p) for p, h in zip(params, has, strict=True) if h and not opt.state.get(p)}
    if missing:
        saved = {p: (p.grad, p.detach().clone()) for p in params}
        for p in params:
            p.grad = torch.zeros_like(p) if id(p) in missing else None
        opt.step()
        with torch.no_grad():
            for p, (grad, value) in saved.items():
                p.copy_(value)
                p.grad = grad
