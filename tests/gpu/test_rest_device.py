"""REST get-to-device on a GPU: ``embcache serve`` with a 512 MiB device pool (fd and legacy
IPC), entries put over REST, ``POST /v1/get`` with the GPU's uuid, and a second process that
opens the pool from the JSON descriptor alone (``DevicePoolCache`` + ``materialize``) and
checks every byte: contiguous entries (one offset) and fragmented ones (page ids).

Every process started here is stopped by its pid. Run on a GPU machine with:
    pytest -m gpu tests/gpu/test_rest_device.py
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import torch
from gpukit import run

from embcache.service.daemon_process import DaemonProcess

pytestmark = pytest.mark.gpu

MiB = 1 << 20
TOKEN = "rest-gpu-token"


@dataclass
class Daemon:
    proc: subprocess.Popen[str]
    url: str
    token: str | None
    mode: str

    def client(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120)


# fd mode also runs with a token: descriptors only reach authenticated callers.
@pytest.fixture(params=[("fd", TOKEN), ("legacy", None)], ids=["fd-token", "legacy"])
def daemon(request: pytest.FixtureRequest) -> Iterator[Daemon]:
    mode, token = request.param
    with tempfile.TemporaryDirectory(prefix="ecrest-") as tmp:
        flags = ["--grpc-socket", os.path.join(tmp, "g.sock"), "--host-pool-bytes", "1GiB"]
        flags += ["--device-pool-bytes", "512MiB", "--ipc-mode", mode, "--drain-grace-s", "1"]
        flags += ["--device-free-reserve", "0"]  # the pool is fragmented on purpose below
        if token:
            flags += ["--auth-token", token]
        child = DaemonProcess(flags, timeout=180)
        try:
            assert child.ready["device_pools"], child.ready
            yield Daemon(child.proc, child.http_url, token, mode)
        finally:
            assert child.stop() == 0


TENSORS = """
import torch
def tensors():
    # contig: <= 8 device pages (fits a hole); frag: 16 pages (no 16-page run is free)
    g = torch.Generator().manual_seed(7)
    out = {}
    for dt, size in (("bfloat16", 2), ("float16", 2), ("float32", 4)):
        for kind, shape in (("contig", (577, 512)), ("frag", (4 * 2**20 // size, 1))):
            out[f"rest/{dt}/{kind}"] = (torch.randn(*shape, generator=g) * 3).to(getattr(torch, dt))
    return out
"""

DECODER = (
    TENSORS
    + """
import base64, json, sys
import httpx, torch
from embcache.clients.device.gathers import materialize
from embcache.clients.device.pools import DevicePoolCache, DevicePoolHandle
from embcache.kernels import cuda_mem

url, token = sys.argv[1], sys.argv[2]
want = {k: t.cuda() for k, t in tensors().items()}
headers = {"Authorization": f"Bearer {token}"} if token else {}
cache = DevicePoolCache()
out = {"offset": 0, "pages": 0, "modes": []}
with httpx.Client(base_url=url, headers=headers, timeout=120) as http:
    if token:  # without the token: refused, and no descriptor in the reply
        bare = httpx.post(url + "/v1/get", json={"keys": ["x"], "gpu_uuid": "GPU-x"})
        assert bare.status_code == 401 and "pools" not in bare.json(), bare.text
    request = {"keys": list(want) + ["missing"], "gpu_uuid": cuda_mem.gpu_uuid(0), "ttl_s": 300}
    reply = http.post("/v1/get", json=request)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    pools = {p["pool_id"]: p for p in body["pools"]}
    for r in body["results"]:
        if r["key"] == "missing":
            assert not r["found"]
            continue
        loc, p = r["location"], pools[r["location"]["pool_id"]]
        assert loc["kind"] == "device" and p["kind"] == "device"
        if p["ipc_mode"] == "legacy":
            handle = DevicePoolHandle(
                p["pool_id"], p["gpu_uuid"], p["size"], p["page_bytes"],
                ipc_handle=base64.b64decode(p["ipc_handle"]),
            )
        else:
            assert p["ipc_mode"] == "fd" and p["alloc_size"] >= p["size"], p
            handle = DevicePoolHandle(
                p["pool_id"], p["gpu_uuid"], p["alloc_size"], p["page_bytes"],
                fd_socket=p["fd_socket"], fd_token=int(p["fd_token"]),
            )
        pool = cache.pool_tensor(handle, p["size"])
        got = materialize(
            pool,
            page_bytes=p["page_bytes"],
            page_ids=loc.get("page_ids") or [],
            offset=loc.get("offset"),
            nbytes=r["nbytes"],
            dtype=getattr(torch, r["dtype"]),
            shape=tuple(r["shape"]),
        )
        assert torch.equal(got, want[r["key"]]), r["key"]
        kind = "offset" if "offset" in loc else "pages"
        assert kind == ("offset" if r["key"].endswith("contig") else "pages"), (r["key"], loc)
        out[kind] += 1
    torch.cuda.synchronize()  # done reading before the leases end
    ids = [r["lease_id"] for r in body["results"] if r["found"]]
    out["released"] = http.post("/v1/release", json={"lease_ids": ids}).json()["released"]
    out["opens"] = cache.opens
    out["modes"] = sorted({p["ipc_mode"] for p in body["pools"]})
print(json.dumps(out))
"""
)


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def rest_put(http: httpx.Client, key: str, t: torch.Tensor) -> None:
    headers = {
        "X-Embcache-Dtype": str(t.dtype).removeprefix("torch."),
        "X-Embcache-Shape": ",".join(map(str, t.shape)),
    }
    r = http.put(f"/v1/entries/{key}", content=raw(t), headers=headers)
    assert r.status_code == 201, r.text


def fragment_device_pool(http: httpx.Client, gpu: str) -> None:
    """Fill the 2048-page device pool with 8-page entries, evict every other one: the
    largest free device run is 8 pages, so a 16-page entry lands in several runs."""
    keys = [f"filler-{i}" for i in range(255)]  # 255 x 8 pages: 8 pages left at the end
    for key in keys:
        params = {"dtype": "uint8", "shape": str(2 * MiB)}
        r = http.put(f"/v1/entries/{key}", params=params, content=bytes(2 * MiB))
        assert r.status_code == 201, r.text
    for i in range(0, len(keys), 64):
        body = http.post("/v1/get", json={"keys": keys[i : i + 64], "gpu_uuid": gpu}).json()
        assert all(r["found"] for r in body["results"]), body
        ids = [r["lease_id"] for r in body["results"]]
        assert http.post("/v1/release", json={"lease_ids": ids}).json()["released"] == len(ids)
    evicted = http.post("/v1/evict", json={"keys": keys[1::2]}).json()["evicted"]
    assert len(evicted) == len(keys[1::2])
    device = http.get("/v1/stats").json()["device"][0]
    assert device["largest_free_run_pages"] == 8, device


def test_rest_descriptor_opened_by_another_process(daemon: Daemon) -> None:
    from embcache.kernels import cuda_mem

    gpu = cuda_mem.gpu_uuid(0)
    namespace: dict = {}
    exec(TENSORS, namespace)
    with daemon.client() as http:
        fragment_device_pool(http, gpu)
        for key, t in namespace["tensors"]().items():
            rest_put(http, key, t)
        out = run(DECODER, daemon.url, daemon.token or "")
        assert out["offset"] == 3 and out["pages"] == 3, out
        assert out["released"] == 6 and out["opens"] == 1, out
        assert out["modes"] == [daemon.mode], out
        # A second batch is all resident hits: no new host-to-device copy.
        h2d = http.get("/v1/stats").json()["bytes_copied"]["h2d"]
        keys = list(namespace["tensors"]())
        body = http.post("/v1/get", json={"keys": keys, "gpu_uuid": gpu}).json()
        assert all(r["found"] for r in body["results"])
        assert http.get("/v1/stats").json()["bytes_copied"]["h2d"] == h2d
        ids = [r["lease_id"] for r in body["results"]]
        assert http.post("/v1/release", json={"lease_ids": ids}).json()["released"] == 6
        stats = http.get("/v1/stats").json()
        assert stats["leases_active"] == 0, stats
