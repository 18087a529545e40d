"""CUDA round trip through vLLM's V2 model runner's ``ActiveECConnector``: a producer
process saves CUDA tensors (they reach the daemon by CUDA IPC), a consumer process stages
them onto its GPU with ``get_into`` and hands them to the encoder cache in the order of
vLLM's scheduler (``vllm_kit.Engine``); the bytes are compared. Run by
scripts/gpu_integrations.sh on the H200.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
HERE = Path(__file__).resolve().parent
KIT = HERE.parent / "integrations"

if importlib.util.find_spec("vllm") is None:  # pragma: no cover - carried to the GPU host
    pytest.skip("vllm is not importable (scripts/carry_vllm.sh)", allow_module_level=True)

# One role per process: each builds a real VllmConfig and vLLM's connectors, and goes
# through ActiveECConnector (vLLM 0.33 and 0.34).
ROLE = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import vllm_kit as kit
from pathlib import Path
from vllm.distributed.ec_transfer import (ensure_ec_transfer_initialized,
    ensure_ec_transfer_shutdown, get_ec_transfer)
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.v1.worker.gpu.ec_connector import ActiveECConnector
from embcache.integrations.vllm.metadata import EmbCacheConnectorMetadata
role, folder, extra = sys.argv[2], Path(sys.argv[3]), json.loads(sys.argv[4])
items = {f"gpu-{i}": (64 + 8 * i, 4096) for i in range(4)}
torch.cuda.set_device(0)
torch.cuda.init()
model = kit.model_config(folder)
def expected(i, rows):
    g = torch.Generator(device="cuda").manual_seed(i)
    return torch.randn(rows, 4096, generator=g, device="cuda").to(torch.bfloat16)
if role == "producer":
    config = kit.vllm_config(model, "ec_producer", extra)
    ensure_ec_transfer_initialized(config)
    cache = {}
    active = ActiveECConnector(config, cache)
    with active.maybe_get_output(kit.scheduler_output(EmbCacheConnectorMetadata())):
        for i, (name, (rows, _)) in enumerate(items.items()):
            cache[name] = expected(i, rows)
    assert get_ec_transfer().wait_for_saves(60)
    meta = get_ec_transfer().build_connector_worker_meta()
    print(json.dumps(meta.stats))
    ensure_ec_transfer_shutdown()
else:
    def make(which):
        return ECConnectorFactory.create_connector(
            kit.vllm_config(model, "ec_consumer", extra), which)
    sched, worker = make(ECConnectorRole.SCHEDULER), make(ECConnectorRole.WORKER)
    def encode(identifier):
        raise AssertionError(f"{identifier} was encoded, not loaded")
    engine = kit.Engine(sched, worker, encode)
    engine.add(kit.request("r", [(n, rows) for n, (rows, _) in items.items()]))
    engine.run()
    assert engine.done == {"r": "ok"}, engine.done
    for i, (name, (rows, _)) in enumerate(items.items()):
        got = engine.read["r"][name]
        assert got.is_cuda and got.shape == (rows, 4096)
        assert torch.equal(got, expected(i, rows)), name
    print(json.dumps(sched.get_ec_connector_stats().reduce()))
    worker.shutdown()
    sched.shutdown()
"""


def test_cuda_round_trip_through_active_ec_connector(start_daemon) -> None:  # type: ignore[no-untyped-def]
    assert torch.cuda.is_available()
    sys.path.insert(0, str(KIT))
    import vllm_kit as kit

    with tempfile.TemporaryDirectory() as tmp:
        daemon = start_daemon(
            "--grpc-socket",
            f"{tmp}/d.sock",
            "--host-pool-bytes",
            "1GiB",
            "--device-pool-bytes",
            "512MiB",
        )
        folder = kit.write_model(Path(tmp) / "model")
        extra = json.dumps({"embcache_target": daemon.unix_target, "namespace": "gpu-test"})
        # vLLM's CUDA platform imports its compiled extensions (flash attention) while it
        # inspects a model; the vLLM carried here is pure Python, so its classes run under
        # its CPU platform. The connector and every tensor here are CUDA all the same.
        env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
        runs = {}
        for role in ("producer", "consumer"):
            done = subprocess.run(
                [sys.executable, "-c", ROLE, str(KIT), role, str(folder), extra],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert done.returncode == 0, done.stderr[-4000:]
            runs[role] = json.loads(done.stdout.strip().splitlines()[-1])
        assert runs["producer"]["saves"] == 4
        assert runs["consumer"]["loads"] == 4 and runs["consumer"]["stage_failures"] == 0
        # The puts came from the GPU by CUDA IPC (the daemon copied them device to host),
        # not as streamed bytes; the loads went host to device.
        stats = daemon_stats(daemon.unix_target)
        print("daemon stats:", json.dumps(stats)[:2000])
        item_bytes = sum((64 + 8 * i) * 4096 * 2 for i in range(4))
        assert stats["bytes_copied"]["d2h"] >= item_bytes, stats["bytes_copied"]
        assert stats["bytes_copied"]["h2d"] + stats["bytes_copied"]["d2d"] >= item_bytes


def daemon_stats(target: str) -> dict:  # type: ignore[type-arg]
    from embcache.clients import EmbCacheClient

    with EmbCacheClient(target) as client:
        return client.stats()
