"""uvicorn around the app: in the foreground (``attnplug serve``) or on a thread (tests, benchmarks).

Binding is done here, on a socket of our own, so that ``port=0`` (any free port) tells
its real port before the server starts (``BackgroundServer.url``).
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``0``: a free port).

    Raises:
        OSError: the address is taken or cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def make_server(app, log_level: str = "warning") -> uvicorn.Server:
    return uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",
                                         timeout_graceful_shutdown=5))


class BackgroundServer:
    """``with BackgroundServer(app) as s: ... s.url ...``: uvicorn on a daemon thread.

    Args:
        app: the ASGI app (``create_app``).
        host / port: where to listen (default: loopback, a free port).
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.sock = bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = make_server(app, log_level)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="attnplug-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(30)
        self.sock.close()
