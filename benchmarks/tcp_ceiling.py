"""Loopback TCP between threads of this process: the ceiling the benchmarks hold memkv's figures
against (the same run, the same bytes), and their timing helpers."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable


def gbps(nbytes: int, secs: float) -> float:
    return nbytes / secs / 1e9


def best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


class TcpLoop:
    """`conns` loopback connections, each with a sender and a receiver thread that live for the
    whole benchmark (thread start-up stays out of the timing); one run moves `nbytes` split
    evenly over the connections. Socket calls release the GIL, so the threads run in parallel."""

    def __init__(self, conns: int, nbytes: int) -> None:
        self.part = -(-nbytes // conns)
        self.nbytes = self.part * conns
        lsock = socket.create_server(("127.0.0.1", 0))
        self.socks = []
        self._go = threading.Barrier(2 * conns + 1)
        self._done = threading.Barrier(2 * conns + 1)
        self._stop = False
        self._threads = []
        for _ in range(conns):
            snd = socket.create_connection(lsock.getsockname())
            rcv, _ = lsock.accept()
            for s in (snd, rcv):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.socks += [snd, rcv]
            self._threads += [threading.Thread(target=self._send, args=(snd,), daemon=True),
                              threading.Thread(target=self._receive, args=(rcv,), daemon=True)]
        lsock.close()
        for t in self._threads:
            t.start()

    def _send(self, s: socket.socket) -> None:
        src = memoryview(bytearray(self.part))
        while True:
            self._go.wait()
            if self._stop:
                return
            s.sendall(src)
            self._done.wait()

    def _receive(self, s: socket.socket) -> None:
        dst = memoryview(bytearray(self.part))
        while True:
            self._go.wait()
            if self._stop:
                return
            got = 0
            while got < self.part:
                got += s.recv_into(dst[got:], min(self.part - got, 1 << 20))
            self._done.wait()

    def once(self) -> None:
        self._go.wait()
        self._done.wait()

    def close(self) -> None:
        self._stop = True
        self._go.wait()
        for t in self._threads:
            t.join()
        for s in self.socks:
            s.close()


def tcp_ceiling(nbytes: int, repeat: int, conns: int) -> float:
    """Over at least 256 MiB: below that, waking the threads is a visible part of a run and the
    figure swings by 3x from one run to the next (seen on the H200 host)."""
    loop = TcpLoop(conns, max(nbytes, 256 << 20))
    try:
        loop.once()
        return gbps(loop.nbytes, best(loop.once, repeat))
    finally:
        loop.close()
