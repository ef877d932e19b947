"""A TCP proxy in front of PostgreSQL that cuts one session right after forwarding its COMMIT.

`arm(marker)`: the next session that sends `marker` (bytes of a statement or a parameter) has the
connection cut as soon as its next COMMIT went to the server: PostgreSQL commits the transaction,
the client never hears so (its driver reports the session lost, the outcome unknown). Fires once
per `arm`. Every other session is passed through untouched.
"""

from __future__ import annotations

import socket
import threading
import time


class CommitCutProxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.fired = threading.Event()
        self._marker: bytes | None = None
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = int(self.sock.getsockname()[1])
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def url_for(self, url: str) -> str:
        """`url` (a postgresql:// URL to the upstream) through this proxy."""
        host = f"{self.upstream[0]}:{self.upstream[1]}"
        assert host in url, (host, url)
        return url.replace(host, f"127.0.0.1:{self.port}", 1)

    def arm(self, marker: bytes) -> None:
        with self._lock:
            self._marker = marker
            self.fired.clear()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, server]
            cut = threading.Event()
            threading.Thread(target=self._up, args=(cut, client, server), daemon=True).start()
            threading.Thread(target=self._down, args=(cut, client, server), daemon=True).start()

    @staticmethod
    def _commits(data: bytes, names: set[bytes]) -> bool:
        """Whether `data` (whole protocol messages) runs COMMIT: a simple query, a Parse of it (its
        statement name remembered: psycopg prepares what it runs often), or a Bind of one so named."""
        found, i = False, 0
        while i + 5 <= len(data):
            kind = data[i : i + 1]
            n = int.from_bytes(data[i + 1 : i + 5], "big")
            body = data[i + 5 : i + 1 + n]
            if kind == b"Q" and body.rstrip(b"\0").strip().upper() == b"COMMIT":
                found = True
            elif kind == b"P":
                name, _, rest = body.partition(b"\0")
                if rest.partition(b"\0")[0].strip().upper() == b"COMMIT":
                    if name:
                        names.add(name)
                    found = True
            elif kind == b"B":
                stmt = body.partition(b"\0")[2].partition(b"\0")[0]
                found = found or bool(stmt and stmt in names)
            if n < 4:
                break
            i += 1 + n
        return found

    def _up(self, cut: threading.Event, client: socket.socket, server: socket.socket) -> None:
        armed, started, names = False, False, set[bytes]()
        try:
            while True:
                data = client.recv(65536)
                if not data:
                    break
                commit = started and self._commits(data, names)
                started = True  # the startup message has no type byte
                with self._lock:
                    marker = self._marker if not self.fired.is_set() else None
                    if marker is not None and marker in data:
                        armed = True
                    fire = armed and commit and marker is not None
                    if fire:
                        self.fired.set()
                        self._marker = None
                if fire:
                    cut.set()
                    server.sendall(data)
                    time.sleep(0.3)  # PostgreSQL commits
                    break
                server.sendall(data)
        except OSError:
            pass
        for s in (client, server):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _down(self, cut: threading.Event, client: socket.socket, server: socket.socket) -> None:
        try:
            while True:
                data = server.recv(65536)
                if not data or cut.is_set():
                    break
                client.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self._stop = True
        self.sock.close()
        with self._lock:
            for s in self._sockets:
                try:
                    s.close()
                except OSError:
                    pass
