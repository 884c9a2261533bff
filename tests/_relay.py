"""A TCP relay that delays every byte by a fixed time each way: the round trip a client
through it sees grows by twice ``--delay-ms``. The kernel here has no ``netem``, so the
emulated hosts of :mod:`tests.hosts` reach Redis through one of these.

    python -m tests._relay --listen 10.1.2.1:6380 --to 127.0.0.1:6379 --delay-ms 2.5

Bytes keep their order and their timing: each chunk read is written once its arrival time
plus the delay has come, so a stream of requests is delayed, not batched. Threads, not an
event loop: ``time.sleep`` keeps a delay to a few tens of microseconds, where an epoll
timeout rounds up to the next millisecond. Bounded: at most ``--buffer`` bytes wait per
direction of a connection (then it stops reading: TCP's own back-pressure reaches the
sender), and it stops by itself when the process that started it dies, or after
``--max-s`` seconds. TLS passes through untouched (the relay sees bytes)."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import queue
import signal
import socket
import threading
import time

CHUNK = 65536


def pump(src: socket.socket, dst: socket.socket, delay: float, buffer: int) -> None:
    """Copy ``src`` to ``dst``, each chunk ``delay`` seconds after it came; at the end (either
    side closed or failed) shut ``dst``'s sending side."""
    line: queue.Queue[tuple[float, bytes]] = queue.Queue(maxsize=max(buffer // CHUNK, 1))

    def read() -> None:
        data = b""
        try:
            while data := src.recv(CHUNK):
                line.put((time.monotonic() + delay, data))
        except OSError:
            pass
        line.put((0.0, b""))

    threading.Thread(target=read, daemon=True).start()
    try:
        while True:
            due, data = line.get()
            if not data:
                break
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)  # the delay itself: this chunk is due then
            dst.sendall(data)
    except OSError:
        pass
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


def relay(client: socket.socket, to: tuple[str, int], delay: float, buffer: int) -> None:
    try:
        upstream = socket.create_connection(to)
    except OSError:
        client.close()
        return
    for s in (client, upstream):  # small requests go at once (Redis's are)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    back = threading.Thread(target=pump, args=(upstream, client, delay, buffer), daemon=True)
    back.start()
    pump(client, upstream, delay, buffer)
    back.join()
    client.close()
    upstream.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--listen", required=True, help="HOST:PORT to accept clients on")
    ap.add_argument("--to", required=True, help="HOST:PORT to forward them to")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="added each way")
    ap.add_argument("--buffer", type=int, default=16 << 20, help="bytes waiting per direction")
    ap.add_argument("--max-s", type=float, default=3600.0, help="stop after this long")
    args = ap.parse_args()
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    host, port = args.listen.rsplit(":", 1)
    to_host, to_port = args.to.rsplit(":", 1)
    server = socket.create_server((host, int(port)), reuse_port=False)
    server.settimeout(1.0)
    print("ready", flush=True)
    end = time.monotonic() + args.max_s
    while time.monotonic() < end:
        try:
            client, _ = server.accept()
        except TimeoutError:
            continue
        threading.Thread(
            target=relay,
            args=(client, (to_host, int(to_port)), args.delay_ms / 1000, args.buffer),
            daemon=True,
        ).start()


if __name__ == "__main__":
    main()
