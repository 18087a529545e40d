"""Start worker processes (``relkit.worker``) and collect their JSON lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .daemon import clean_env, read_json_line, reap

RELDIR = Path(__file__).resolve().parents[1]


@dataclass
class Worker:
    proc: subprocess.Popen[str]
    cfg: dict[str, Any]
    stderr_path: Path
    done: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, event: str, timeout: float) -> dict[str, Any]:
        return read_json_line(self.proc.stdout, self.proc, event, timeout)

    def stderr(self, nbytes: int = 3000) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-nbytes:]
        except OSError:
            return ""


def spawn(cfg: dict[str, Any], workdir: Path, name: str) -> Worker:
    """Start a worker and hand it its config (it then connects and says ``ready``)."""
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(RELDIR), env.get("PYTHONPATH")) if p)
    stderr_path = workdir / f"{name}.err"
    with stderr_path.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "relkit.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )
    worker = Worker(proc, cfg, stderr_path)
    worker.send(json.dumps(cfg))
    return worker


def finish(workers: list[Worker], timeout: float) -> None:
    """Wait for each worker's ``done`` line and exit (bounded), then reap them all."""
    try:
        for w in workers:
            w.done = w.expect("done", timeout)
            w.proc.wait(timeout)
    finally:
        for w in workers:
            reap(w.proc)
