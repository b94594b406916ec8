"""A GCS emulator on loopback for tests, behind a proxy that enforces generation preconditions
(gcp-storage-emulator ignores `ifGenerationMatch`) and injects faults (503s, delays, uploads
dropped mid-body).

`start()` returns a `Gcs` whose `env` points the clients at the proxy (gcsfs and
google-cloud-storage read STORAGE_EMULATOR_HOST, tensorstore TENSORSTORE_GCS_HTTP_URL).
"""

import http.client
import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field

BUCKET = "runs"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Fault:
    """`times` requests whose "METHOD path?query object-name" matches `pattern` get `kind`:
    "503" (a Service Unavailable reply), "drop" (the connection closed mid-request, nothing
    forwarded) or "delay" (forwarded after `delay_s`). times=-1: every matching request."""

    pattern: str
    kind: str = "503"
    times: int = 1
    delay_s: float = 0.0
    hits: int = 0


@dataclass
class Proxy:
    upstream: int
    faults: list[Fault] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    log: list[str] = field(default_factory=list)
    # The emulator serves one request at a time with a listen backlog of 5: more connections
    # at once are refused. Hold the proxy's to the emulator to a few.
    upstream_slots: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(4))

    def take_fault(self, line: str) -> Fault | None:
        with self.lock:
            for f in self.faults:
                if f.times != 0 and re.search(f.pattern, line):
                    f.times -= 1 if f.times > 0 else 0
                    f.hits += 1
                    return f
        return None


def _object_name(path: str, query: dict, body: bytes) -> tuple[str, str] | None:
    """(bucket, object) a request writes or deletes, from its URL or its upload metadata."""
    m = re.match(r"/(?:upload/)?storage/v1/b/([^/]+)/o(?:/([^?]+))?", path)
    if not m:
        return None
    bucket, name = m.group(1), m.group(2)
    if name:
        return bucket, urllib.parse.unquote(name)
    if "name" in query:
        return bucket, query["name"]
    found = re.search(rb'"name"\s*:\s*"((?:[^"\\]|\\.)*)"', body[:65536])
    return (bucket, json.loads(b'"' + found.group(1) + b'"')) if found else None


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    proxy: Proxy  # set on the subclass

    def log_message(self, *args):
        pass

    def handle_one_request(self):
        try:
            super().handle_one_request()
        except (ConnectionError, TimeoutError):
            self.close_connection = True  # a client gave up (a timeout, a retry): not news

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _reply(self, status: int, body: bytes, headers=()) -> None:
        self.send_response(status)
        for k, v in headers:
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _generation(self, bucket: str, name: str) -> int:
        """The object's current generation upstream; 0 if absent."""
        quoted = urllib.parse.quote(name, safe="")
        url = f"http://127.0.0.1:{self.proxy.upstream}/storage/v1/b/{bucket}/o/{quoted}"
        try:
            with self.proxy.upstream_slots, urllib.request.urlopen(url) as r:
                return int(json.load(r)["generation"])
        except urllib.error.HTTPError:
            return 0

    def _forward(self, body: bytes, extra_headers=()) -> None:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
        with self.proxy.upstream_slots:
            conn = http.client.HTTPConnection("127.0.0.1", self.proxy.upstream, timeout=60)
            conn.request(self.command, self.path, body=body or None, headers=headers)
            r = conn.getresponse()
            data = r.read()
            conn.close()
        headers = r.getheaders() + (list(extra_headers) if r.status == 200 else [])
        self._reply(r.status, data, headers)

    def _handle(self) -> None:
        body = self._body()
        url = urllib.parse.urlparse(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        target = _object_name(url.path, query, body)
        line = f"{self.command} {self.path} {target[1] if target else ''}"
        self.proxy.log.append(line)
        fault = self.proxy.take_fault(line)
        if fault is not None and fault.kind == "drop":  # the upload never reaches the store
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if fault is not None and fault.kind == "503":
            err = json.dumps({"error": {"code": 503, "message": "injected"}}).encode()
            self._reply(503, err, [("Content-Type", "application/json")])
            return
        if fault is not None and fault.kind == "delay":
            time.sleep(fault.delay_s)
        conditional = {"ifGenerationMatch", "ifGenerationNotMatch"} & set(query)
        media_read = self.command == "GET" and query.get("alt") == "media"
        if target is None or not (conditional or media_read):
            self._forward(body)
            return
        with self.proxy.lock:  # the check and the request as one step
            gen = self._generation(*target)
            if "ifGenerationMatch" in query and gen != int(query["ifGenerationMatch"]):
                err = {"error": {"code": 412, "message": "conditionNotMet"}}
                self._reply(412, json.dumps(err).encode(), [("Content-Type", "application/json")])
                return
            if gen and str(gen) == query.get("ifGenerationNotMatch") and self.command == "GET":
                self._reply(304, b"", [("x-goog-generation", str(gen))])
                return
            # The emulator's media reads lack the generation header tensorstore needs.
            extra = [("x-goog-generation", str(gen)), ("x-goog-metageneration", "1")] if gen else []
            self._forward(body, extra)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _handle


@dataclass
class Gcs:
    """A running emulator and its proxy; `env` are the variables the clients read."""

    process: subprocess.Popen
    server: http.server.ThreadingHTTPServer
    proxy: Proxy
    url: str

    @property
    def env(self) -> dict[str, str]:
        return {
            "STORAGE_EMULATOR_HOST": self.url,
            "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GOOGLE_CLOUD_PROJECT": "test",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        }

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.process.kill()
        self.process.wait()


def _wait_up(url: str, process: subprocess.Popen) -> None:
    for _ in range(300):
        if process.poll() is not None:
            raise RuntimeError(f"gcp-storage-emulator exited with {process.returncode}")
        try:
            urllib.request.urlopen(f"{url}/storage/v1/b", timeout=2)
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"gcp-storage-emulator did not answer at {url}")


def start() -> Gcs:
    """The emulator (in memory, bucket `runs`) on a free loopback port, and the proxy."""
    port = free_port()
    cmd = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host=127.0.0.1"]
    cmd += [f"--port={port}", "--in-memory", f"--default-bucket={BUCKET}"]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_up(f"http://127.0.0.1:{port}", process)
    proxy = Proxy(upstream=port)
    handler = type("Handler", (_Handler,), {"proxy": proxy})
    server_class = type("Server", (http.server.ThreadingHTTPServer,), {"request_queue_size": 256})
    server = server_class(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return Gcs(process, server, proxy, f"http://127.0.0.1:{server.server_address[1]}")


@contextmanager
def running():
    """A started emulator with this process's clients pointed at it (variables restored after)."""
    import gcsfs

    server = start()
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    gcsfs.GCSFileSystem.clear_instance_cache()  # a cached client keeps its endpoint
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        gcsfs.GCSFileSystem.clear_instance_cache()
