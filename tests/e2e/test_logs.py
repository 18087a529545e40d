"""One log format for embcache's and uvicorn's lines, and one ready event."""

from __future__ import annotations

import json
import os
import re
import subprocess
import uuid

import pytest

from embcache.service.daemon_process import read_line, serve_command, stop

TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) \S+: ")


def run_daemon(*flags: str) -> tuple[list[str], list[str]]:
    """Start a daemon at log level info, stop it once ready: (stdout lines, stderr lines)."""
    name = f"embcache-logs-{uuid.uuid4().hex[:8]}"
    cmd = serve_command("--host-pool-bytes", "16MiB", "--shm-name", name, *flags,
                        "--log-level", "info")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBCACHE_")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)  # fmt: skip
    try:
        first = read_line(proc, '"ready"', 120)
    finally:
        assert stop(proc, timeout=30) == 0
    assert proc.stdout is not None and proc.stderr is not None
    rest = proc.communicate(timeout=10)
    out = [first, *rest[0].splitlines()]
    return [line for line in out if line.strip()], rest[1].splitlines()


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_one_format_and_one_ready_event(fmt: str) -> None:
    stdout, stderr = run_daemon("--log-format", fmt)
    assert len(stdout) == 1 and json.loads(stdout[0])["event"] == "ready"
    assert stderr, "info lines expected"
    loggers = set()
    for line in stderr:
        if fmt == "json":
            record = json.loads(line)
            assert {"time", "level", "logger", "message"} <= set(record), line
            loggers.add(record["logger"])
            message = record["message"]
        else:
            match = TEXT_LINE.match(line)
            assert match, line
            loggers.add(line.split()[3].rstrip(":"))
            message = line[match.end() :]
        assert not message.startswith("ready"), line  # the event is on stdout only
    assert all(name.startswith("embcache") for name in loggers), loggers  # uvicorn's too
    ready = json.loads(stdout[0])
    messages = [json.loads(line)["message"] if fmt == "json" else line for line in stderr]
    text = "\n".join(messages)
    # One line per listener, the HTTP one with its URL and the paths an operator opens.
    http = f"http://127.0.0.1:{ready['http_port']}"
    assert f"gRPC listening on 127.0.0.1:{ready['grpc_port']}" in text
    assert f"session socket listening on TCP 127.0.0.1:{ready['session_socket_tcp_port']}" in text
    assert f"HTTP listening on {http}/" in text
    for path in ("/docs", "/metrics"):
        assert f"{http}{path}" in text
    assert sum("listening on" in m for m in messages) == 3, messages
    # Nothing of uvicorn's start-up chatter, no packaging warnings.
    assert "Waiting for application startup" not in text and "Started server process" not in text
    assert "setuptools" not in text and "absent from the" not in text


def test_unix_socket_listeners_are_announced() -> None:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ecl-") as folder:
        sock = f"{folder}/d.sock"
        _, stderr = run_daemon("--grpc-socket", sock, "--session-socket-tcp", "off")
        text = "\n".join(stderr)
    assert f"gRPC listening on unix:{sock}" in text
    assert f"session socket listening on unix:{sock}.lane" in text
    assert "session socket listening on TCP" not in text
