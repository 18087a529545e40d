"""Tools of the fairness suite (issue 28, items 4-10): a session spoken by hand on the
session socket, raw gRPC puts, and a probe that measures how long the data plane stalls."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType

import grpc

from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.embcache.v1 import services as pb_grpc
from embcache.proto.framing import FRAME_HEADER, frame

SESSION_KEY = "x-embcache-session"
# A channel of its own connection: channels of one process otherwise share a subchannel
# (one TCP connection) per target.
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)


class RawLane:
    """One session on the session socket, its frames written and read by hand."""

    def __init__(self, path: Path | str, name: str = "raw-lane", timeout: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(str(path))
        self.send(pb.SessionRequest(hello=pb.SessionHello(client_name=name, pid=0)))
        opened = self.recv()
        assert opened.WhichOneof("kind") == "opened", opened
        self.session_id = opened.opened.session_id
        self._ids = iter(range(1, 1 << 62))

    def send(self, msg: pb.SessionRequest) -> None:
        self.sock.sendall(frame(msg))

    def recv(self) -> pb.SessionResponse:
        (size,) = FRAME_HEADER.unpack(self._exactly(FRAME_HEADER.size))
        return pb.SessionResponse.FromString(self._exactly(size))

    def _exactly(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            got = self.sock.recv(n - len(out))
            if not got:
                raise ConnectionResetError("the daemon closed the session socket")
            out += got
        return bytes(out)

    def call(self, **request: object) -> pb.SessionResult:
        """One call, waited for (results of other calls are skipped)."""
        call_id = next(self._ids)
        call = pb.SessionCall(call_id=call_id, **request)  # type: ignore[arg-type]
        self.send(pb.SessionRequest(call=call))
        while True:
            msg = self.recv()
            if msg.WhichOneof("kind") == "result" and msg.result.call_id == call_id:
                return msg.result

    def ping(self, value: int = 7) -> None:
        self.send(pb.SessionRequest(ping=value))
        while True:
            msg = self.recv()
            if msg.WhichOneof("kind") == "pong":
                assert msg.pong == value
                return

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawLane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def lane_path(daemon_ready: dict[str, object]) -> Path:
    return Path(str(daemon_ready["session_socket"]))


def put_messages(
    key: str, nbytes: int, sent: int, then: Callable[[], None]
) -> Iterator[pb.PutRequest]:
    """A Put of ``nbytes`` that sends its header and ``sent`` bytes, then calls ``then()``
    (which blocks: the stall) before the rest."""
    yield pb.PutRequest(header=pb.PutHeader(key=key, dtype="uint8", shape=[nbytes], nbytes=nbytes))
    if sent:
        yield pb.PutRequest(chunk=b"\0" * sent)
    then()
    left = nbytes - sent
    while left > 0:
        n = min(left, 1 << 20)
        yield pb.PutRequest(chunk=b"\0" * n)
        left -= n


class StalledPut:
    """A raw gRPC Put in a thread that sends its header (and ``sent`` bytes) and then
    nothing until :meth:`finish`: its outcome is in ``error`` / ``reply``."""

    def __init__(
        self, target: str, key: str, nbytes: int, *, sent: int = 0, metadata: tuple = ()
    ) -> None:
        self._go = threading.Event()
        self.error: grpc.RpcError | None = None
        self.reply: pb.PutResponse | None = None
        self._channel = grpc.insecure_channel(target, options=OWN_CONNECTION)
        stub = pb_grpc.EmbeddingCacheStub(self._channel)
        messages = put_messages(key, nbytes, sent, lambda: self._go.wait(60))

        def run() -> None:
            try:
                self.reply = stub.Put(messages, metadata=metadata, timeout=60)
            except grpc.RpcError as err:
                self.error = err

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def finish(self, timeout: float = 30.0) -> None:
        self._go.set()
        self._thread.join(timeout)
        self._channel.close()


class StallProbe:
    """Calls ``fn`` over and over in a thread while the block runs; ``worst_s`` is the
    longest one call took (how long the data plane stalled)."""

    def __init__(self, fn: Callable[[], object], period_s: float = 0.005) -> None:
        self._fn = fn
        self._period = period_s
        self._stop = threading.Event()
        self.worst_s = 0.0
        self.calls = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            self._fn()
            self.worst_s = max(self.worst_s, time.perf_counter() - t0)
            self.calls += 1
            time.sleep(self._period)

    def __enter__(self) -> StallProbe:
        self._thread.start()
        time.sleep(0.05)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join(30)
