"""What a client says when its program does not: the token from ``EMBCACHE_AUTH_TOKEN``
(as the CLI reads it; an explicit argument wins) and a session name ``<program>:<pid>``."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from embcache.service.daemon_process import DaemonProcess

TOKEN = "defaults-token"

SCRIPT = """
import os, sys, httpx, torch
from embcache.clients import EmbCacheClient
from embcache.errors import EmbCacheError

grpc, http, token_arg = sys.argv[1], sys.argv[2], sys.argv[3:]
kwargs = {"token": token_arg[0]} if token_arg else {}
with EmbCacheClient(grpc, retries=0, **kwargs) as client:
    try:
        client.put("defaults/1", torch.ones(8))
        with client.get(["defaults/1"]) as [tensor]:
            sessions = httpx.get(http + "/v1/sessions",
                                 headers={"Authorization": "Bearer " + os.environ["WANT"]}).json()
            mine = [s["client_name"] for s in sessions["sessions"] if s["pid"] == os.getpid()]
            print("name", *mine)
    except EmbCacheError as exc:
        print("refused", type(exc).__name__)
"""


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    child = DaemonProcess(["--host-pool-bytes", "16MiB", "--device", "cpu", "--auth-token", TOKEN])
    try:
        yield child
    finally:
        child.stop(timeout=15)


def run_job(tmp_path: Path, daemon: DaemonProcess, env_token: str | None, *arg: str) -> str:
    script = tmp_path / "encoder_job.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBCACHE_")}
    env["WANT"] = TOKEN
    if env_token is not None:
        env["EMBCACHE_AUTH_TOKEN"] = env_token
    cmd = [sys.executable, str(script), daemon.grpc_target, daemon.http_url, *arg]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_token_from_the_environment_and_a_default_name(
    tmp_path: Path, daemon: DaemonProcess
) -> None:
    out = run_job(tmp_path, daemon, TOKEN)
    assert out.startswith("name encoder_job.py:"), out
    assert out.split(":")[-1].isdigit()


def test_without_a_token_the_daemon_refuses(tmp_path: Path, daemon: DaemonProcess) -> None:
    assert run_job(tmp_path, daemon, None).startswith("refused"), "no token anywhere"


def test_an_explicit_token_wins_over_the_environment(tmp_path: Path, daemon: DaemonProcess) -> None:
    assert run_job(tmp_path, daemon, TOKEN, "wrong-token").startswith("refused")
    assert run_job(tmp_path, daemon, "wrong-token", TOKEN).startswith("name encoder_job.py:")


def test_program_names(monkeypatch: pytest.MonkeyPatch) -> None:
    from embcache.clients.core.identity import default_client_name, default_token

    assert default_client_name("decoder-3") == "decoder-3"
    assert default_client_name(None).endswith(f":{os.getpid()}")
    monkeypatch.delenv("EMBCACHE_AUTH_TOKEN", raising=False)
    assert default_token(None) is None and default_token("t") == "t" and default_token("") is None
