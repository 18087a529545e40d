"""Listeners, names and configs a hostile local user or a careless operator could abuse
(issue 28, items 11-14): TLS alone on an exposed bind, writable segments, predictable or
colliding segment names, REST keys that are not UTF-8, unchecked keys on Exists, and shapes
whose validity depended on the order of their dimensions."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from pydantic import ValidationError
from relkit import daemon as dm
from relkit import figures

from embcache.clients import EmbCacheClient
from embcache.errors import InvalidArgument
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.embcache.v1 import services as pb_grpc
from embcache.service.config import Settings
from embcache.service.host import admission, host_pool
from embcache.service.host.host_pool import SHM_DIR, HostPool, PoolInUseError, unique_host_pool

FIG: dict[str, object] = {}


# -- item 11: exposed listeners need a token or mTLS; the segment is the owner's to write ---
def test_tls_alone_does_not_open_an_exposed_listener(tmp_path: Path) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    with pytest.raises(ValidationError, match="mTLS"):
        Settings(grpc_host="0.0.0.0", tls_cert=cert, tls_key=key)
    assert Settings(grpc_host="0.0.0.0", tls_cert=cert, tls_key=key, auth_token="t").auth_token
    mtls = Settings(grpc_host="0.0.0.0", tls_cert=cert, tls_key=key, tls_client_ca=cert)
    assert mtls.tls_client_ca == cert
    with pytest.raises(ValidationError, match="needs tls_cert"):
        Settings(tls_client_ca=cert)
    FIG["exposed bind with TLS alone"] = "refused at start (needs a token or mTLS)"


@pytest.mark.parametrize("mode", ["0660", "0662", "0620", "0666"])
def test_segment_modes_that_let_others_write_are_refused(mode: str) -> None:
    with pytest.raises(ValidationError, match="write the segment"):
        Settings(shm_mode=mode)


@pytest.mark.parametrize("mode", ["0600", "0640", "0644"])
def test_readable_segment_modes_are_fine(mode: str) -> None:
    assert Settings(shm_mode=mode).shm_mode == mode


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("certs")
    out = {name: d / f"{name}.pem" for name in ("ca", "ca_key", "srv", "srv_key", "cli", "cli_key")}
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=ca",
             "-keyout", str(out["ca_key"]), "-out", str(out["ca"]))  # fmt: skip
    ext = d / "san.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for who, cn in (("srv", "localhost"), ("cli", "decoder")):
        csr = d / f"{who}.csr"
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}",
                 "-keyout", str(out[f"{who}_key"]), "-out", str(csr))  # fmt: skip
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(out["ca"]), "-CAkey",
                 str(out["ca_key"]), "-CAcreateserial", "-days", "1", "-extfile", str(ext),
                 "-out", str(out[who]))  # fmt: skip
    return out


@pytest.fixture
def mtls_daemon(tmp_path: Path, certs: dict[str, Path]) -> Iterator[dm.Daemon]:
    tls = ("--tls-cert", str(certs["srv"]), "--tls-key", str(certs["srv_key"]))
    extra = (*tls, "--tls-client-ca", str(certs["ca"]), "--grpc-port", "0", "--http-port", "0")
    d = dm.start(dm.DaemonSpec(tmp_path, extra=extra))
    try:
        yield d
    finally:
        dm.stop(d)


def test_mtls_lets_in_only_clients_with_a_certificate(
    mtls_daemon: dm.Daemon, certs: dict[str, Path]
) -> None:
    ca, cert, key = (certs[n].read_bytes() for n in ("ca", "cli", "cli_key"))
    target = f"localhost:{mtls_daemon.ready['grpc_port']}"
    anonymous = EmbCacheClient(target, root_certificates=ca, timeout=5, retries=0)
    with anonymous, pytest.raises(Exception) as refused:
        anonymous.exists(["k"])
    assert "UNAVAILABLE" in str(refused.value) or "handshake" in str(refused.value).lower()
    with EmbCacheClient(
        target, root_certificates=ca, private_key=key, certificate_chain=cert, timeout=10
    ) as client:
        assert client.exists(["k"]) == [False]
    url = f"https://localhost:{mtls_daemon.ready['http_port']}/v1/stats"
    bare = ssl.create_default_context(cafile=str(certs["ca"]))
    with pytest.raises(httpx.HTTPError):
        httpx.get(url, verify=bare, timeout=5)
    with_cert = ssl.create_default_context(cafile=str(certs["ca"]))
    with_cert.load_cert_chain(str(certs["cli"]), str(certs["cli_key"]))
    reply = httpx.get(url, verify=with_cert, timeout=5)
    assert reply.status_code == 200
    FIG["mTLS client without / with a certificate"] = "refused at the handshake / served"


# -- item 12: segment names nobody can take first, and no collisions ---------------------
def test_two_daemons_on_port_zero_get_their_own_segments(tmp_path: Path) -> None:
    specs = [
        dm.DaemonSpec(tmp_path / n, shm_name="", extra=("--grpc-port", "0", "--http-port", "0"))
        for n in ("a", "b")
    ]
    daemons = [dm.start(spec) for spec in specs]
    try:
        names = [d.ready["shm_name"] for d in daemons]
        assert names[0] != names[1] and all(n.startswith("embcache-0-") for n in names)
        assert all((SHM_DIR / n).exists() for n in names)
    finally:
        for d in daemons:
            dm.stop(d)
    assert not any((SHM_DIR / n).exists() for n in names)
    FIG["two daemons with --grpc-port 0"] = "two segments (embcache-0-<random>)"


def test_a_name_another_user_took_is_never_adopted() -> None:
    name = f"embcache-rel-taken-{uuid.uuid4().hex[:8]}"
    path = SHM_DIR / name
    path.write_bytes(b"")
    os.chown(path, 65534, 65534)  # "nobody" created it first
    try:
        with pytest.raises(PoolInUseError, match="belongs to uid 65534"):
            HostPool(name, 1 << 20, 1 << 16)
        pool = unique_host_pool(name, 1 << 20, 1 << 16)  # the default naming goes around it
        try:
            assert pool.name != name and pool.name.startswith(name + "-")
        finally:
            pool.close()
    finally:
        path.unlink(missing_ok=True)
    FIG["a segment name taken first by another user"] = "refused by name; a random one is used"


def test_stale_segments_of_dead_daemons_are_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = f"embcache-rel-stale-{uuid.uuid4().hex[:8]}"
    stale, live = SHM_DIR / f"{prefix}-dead", HostPool(f"{prefix}-live", 1 << 20, 1 << 16)
    stale.write_bytes(b"\0" * 4096)  # nobody holds its lock: its daemon died
    try:
        assert host_pool.remove_stale_segments(prefix) == 1
        assert not stale.exists() and live.path.exists()  # a live daemon's is kept
    finally:
        live.close()
        stale.unlink(missing_ok=True)


# -- item 13: keys that are not UTF-8, unchecked keys on Exists ---------------------------
@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dm.Daemon]:
    d = dm.start(dm.DaemonSpec(tmp_path_factory.mktemp("names")))
    try:
        yield d
    finally:
        dm.stop(d)


@pytest.mark.parametrize("path", ["/v1/entries/%FF", "/v1/entries/a%FEb", "/v1/entries/%C3"])
def test_rest_keys_that_are_not_utf8_are_refused(daemon: dm.Daemon, path: str) -> None:
    for method in ("GET", "DELETE", "PUT"):
        reply = httpx.request(method, daemon.http + path, content=b"x", timeout=10)
        assert reply.status_code == 400, (method, reply.text)
        assert reply.json()["error"] == "InvalidArgument"
    assert daemon.stats()["entries_ready"] == 0  # nothing was stored under U+FFFD
    FIG["REST key %FF / %FE"] = "400 (they no longer alias one key)"


def test_a_utf8_key_still_works_over_rest(daemon: dm.Daemon) -> None:
    put = httpx.put(daemon.http + "/v1/entries/caf%C3%A9?dtype=uint8&shape=3", content=b"abc")
    assert put.status_code == 201, put.text
    got = httpx.get(daemon.http + "/v1/entries/caf%C3%A9/data")
    assert got.status_code == 200 and got.content == b"abc"


@pytest.mark.parametrize("key", ["", "k" * 5000])
def test_exists_checks_its_keys_like_every_other_call(daemon: dm.Daemon, key: str) -> None:
    with grpc.insecure_channel(daemon.unix) as channel:
        stub = pb_grpc.EmbeddingCacheStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Exists(pb.ExistsRequest(keys=["fine", key]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    FIG["Exists of an empty / over-long key"] = "INVALID_ARGUMENT"


# -- item 14: a shape's validity does not depend on the order of its dimensions -----------
@pytest.mark.parametrize(
    ("dims", "dtype", "ok"),
    [
        ([0, 2**63 - 1], "uint8", True),
        ([0, 2**63 - 1], "float32", False),
        ([0, 2**62, 4], "uint8", False),
        ([3, 0, 2**40], "bfloat16", True),
    ],
)
def test_shape_validity_ignores_the_order_of_dims(dims: list[int], dtype: str, ok: bool) -> None:
    s = Settings()
    for order in (dims, dims[::-1], dims[1:] + dims[:1]):
        if ok:
            assert admission.check_meta(dtype, order, None, s).nbytes == 0
        else:
            with pytest.raises(InvalidArgument, match="overflows"):
                admission.check_meta(dtype, order, None, s)
    FIG["[0, 2**63-1] against [2**63-1, 0]"] = "the same answer"


def test_zz_figures() -> None:
    print("\n" + figures.table("names, listeners and shapes (CI)", FIG))
    figures.save("safe_names", FIG)
