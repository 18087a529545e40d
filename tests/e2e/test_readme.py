"""The README's code blocks run as written: its Python against a live daemon, its shell
commands checked by ``bash -n`` and, for the ``embcache`` operator commands, run as users
run them. The daemon listens on free ports; the blocks' default address (127.0.0.1:7470
for gRPC, 7471 for HTTP) is pointed at it, and nothing else is changed."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import embcache
from embcache.service.config import DEPRECATED_NAMES, Settings
from embcache.service.daemon_process import DaemonProcess

README = Path(embcache.__file__).resolve().parent / "README.md"
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
# Commands that install or run for long: syntax-checked only.
NOT_RUN = ("embcache serve", "bash scripts/")


def blocks(language: str) -> list[str]:
    return [body for lang, body in BLOCK.findall(README.read_text()) if lang == language]


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    child = DaemonProcess(["--host-pool-bytes", "64MiB", "--device", "cpu"], timeout=90)
    try:
        yield child
    finally:
        child.stop(timeout=15)


def _env(daemon: DaemonProcess) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBCACHE_")}
    env["EMBCACHE_HTTP_PORT"] = str(daemon.ready["http_port"])
    return env


def test_the_readme_has_python_and_shell_blocks() -> None:
    assert blocks("python") and len(blocks("bash")) >= 2


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_python_block_runs(index: int, daemon: DaemonProcess) -> None:
    code = blocks("python")[index].replace("127.0.0.1:7470", daemon.grpc_target)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=_env(daemon))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.parametrize("index", range(len(blocks("bash"))))
def test_bash_block_is_valid_shell(index: int) -> None:
    out = subprocess.run(["bash", "-n"], input=blocks("bash")[index], capture_output=True,
                         text=True, timeout=30)  # fmt: skip
    assert out.returncode == 0, out.stderr


def _operator_commands() -> list[str]:
    lines = [line.split("#")[0].strip() for body in blocks("bash") for line in body.splitlines()]
    return [line for line in lines if line.startswith("embcache ") and not line.startswith(NOT_RUN)]


def _console_script() -> list[str]:
    script = Path(sys.executable).with_name("embcache")
    return [str(script)] if script.exists() else [sys.executable, "-m", "embcache.service.cli"]


@pytest.mark.parametrize("command", _operator_commands())
def test_operator_command_runs(command: str, daemon: DaemonProcess) -> None:
    argv = [*_console_script(), *shlex.split(command)[1:]]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=_env(daemon))
    assert out.returncode == 0, (command, out.stderr[-2000:])
    assert out.stdout.strip(), command


def test_every_flag_it_names_is_a_setting_or_a_command_flag() -> None:
    text: Any = README.read_text()
    settings = {"--" + n.replace("_", "-") for n in [*Settings.model_fields, *DEPRECATED_NAMES]}
    command_flags = {"--help", "--json", "--sort", "--free", "--list", "--shm-size"}
    named = set(re.findall(r"`(--[a-z][a-z0-9-]*)", text))
    unknown = sorted(named - settings - command_flags)
    assert not unknown, unknown
