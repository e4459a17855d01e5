"""A local S3 (moto server mode) for tests.

    with s3_server() as s3:            # or in a fixture: `with s3_server() as s3: yield s3`
        s3.url("traces/a.parquet")     # -> "s3://test-bucket/traces/a.parquet"

Starts moto on 127.0.0.1 with a free port, points the AWS environment (credentials, region,
AWS_ENDPOINT_URL and AWS_ENDPOINT_URL_S3) at it, creates the bucket, and restores everything on exit,
including s3fs's instance cache so no cached client outlives the server.
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import NamedTuple

ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",  # never wait on an instance-metadata lookup
}
UNSET = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE")  # a real profile must not leak in


class S3Endpoint(NamedTuple):
    endpoint_url: str
    bucket: str

    def url(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{key.lstrip('/')}"

    def filesystem(self):
        """A fresh (uncached) s3fs filesystem for this endpoint, e.g. to upload test files."""
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, client_kwargs={"endpoint_url": self.endpoint_url})


def _clear_s3fs_cache() -> None:
    with contextlib.suppress(ImportError):
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()


@contextlib.contextmanager
def s3_server(bucket: str = "test-bucket") -> Iterator[S3Endpoint]:
    """Yield (endpoint_url, bucket) of a running moto S3; stop it and restore the env after."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no request log lines in test output
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    keys = (*ENV, *UNSET, "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")
    saved = {k: os.environ.get(k) for k in keys}
    try:
        for k in UNSET:
            os.environ.pop(k, None)
        os.environ.update(ENV, AWS_ENDPOINT_URL=endpoint, AWS_ENDPOINT_URL_S3=endpoint)
        _clear_s3fs_cache()
        s3 = S3Endpoint(endpoint, bucket)
        s3.filesystem().mkdir(bucket)
        yield s3
    finally:
        _clear_s3fs_cache()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


class Proxy:
    """A TCP proxy in front of an endpoint that a test can break: `mode` "pass" forwards, "hang"
    accepts connections and never answers (a hung S3), "down" refuses them (port closed).

        with s3_server() as s3, Proxy(s3.endpoint_url) as proxy:
            env["AWS_ENDPOINT_URL"] = proxy.url; ...; proxy.mode = "down"
    """

    def __init__(self, target_url: str):
        from urllib.parse import urlparse

        u = urlparse(target_url)
        self.target = (u.hostname, u.port)
        self.mode = "pass"
        self.held: list = []  # hung connections, kept open
        self._closing = False

    def __enter__(self) -> Proxy:
        import socket
        import threading

        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self.server.close()
        for s in self.held:
            with contextlib.suppress(OSError):
                s.close()

    def _accept(self) -> None:
        import socket
        import threading

        while not self._closing:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            if self.mode == "down":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                conn.close()  # a reset: as good as refused for a client
            elif self.mode == "hang":
                self.held.append(conn)
            else:
                threading.Thread(target=self._forward, args=(conn,), daemon=True).start()

    def _forward(self, conn) -> None:
        import socket
        import threading

        try:
            up = socket.create_connection(self.target)
        except OSError:
            conn.close()
            return

        def pipe(a, b):
            try:
                while self.mode == "pass" and (data := a.recv(65536)):
                    b.sendall(data)
            except OSError:
                pass
            finally:
                for s in (a, b):
                    with contextlib.suppress(OSError):
                        s.shutdown(socket.SHUT_RDWR)

        threading.Thread(target=pipe, args=(up, conn), daemon=True).start()
        pipe(conn, up)
