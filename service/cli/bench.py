"""``embcache bench``: run the scripts in ``bench/`` with progress bars and print their tables
(the daemon's address and token reach them as ``EMBCACHE_*`` variables)."""

# No ``from __future__ import annotations`` here: typer reads the Annotated[...] metadata.
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import typer
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from embcache.service.cli.output import (
    JsonOpt,
    console,
    fail,
    print_json,
    print_tsv,
    to_terminal,
)
from embcache.service.cli.target import CaOpt, TargetOpt, TokenOpt, http_url


def default_bench_dir() -> Path:
    """``bench/`` at the package root: the repository root is the package ``embcache``, so a
    source checkout (and an editable install of it) has it; a wheel does not ship it."""
    import embcache

    return Path(embcache.__file__).resolve().parent / "bench"


def find_benchmarks(bench_dir: Path, only: list[str] | None) -> list[Path]:
    """The scripts of ``bench_dir`` (not ``_private`` ones), or those named in ``only``."""
    scripts = sorted(p for p in bench_dir.glob("*.py") if not p.name.startswith("_"))
    if only:
        wanted = {n.removesuffix(".py") for n in only}
        scripts = [p for p in scripts if p.stem in wanted]
    return scripts


def _bench_env(target: str | None, token: str | None, ca_cert: Path | None) -> dict[str, str]:
    """The scripts' environment: the daemon's address as EMBCACHE_* variables."""
    env = dict(os.environ)
    url = urlsplit(http_url(target, ca_cert))
    env.update(EMBCACHE_TARGET=url.geturl(), EMBCACHE_HTTP_HOST=url.hostname or "127.0.0.1",
               EMBCACHE_HTTP_PORT=str(url.port))  # fmt: skip
    if token:
        env["EMBCACHE_AUTH_TOKEN"] = token
    return env


def bench(
    only: Annotated[list[str] | None, typer.Option("--only", help="Run this script.")] = None,
    bench_dir: Annotated[Path | None, typer.Option(help="Folder of bench scripts.")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds each script may run.")] = 1800.0,
    list_only: Annotated[bool, typer.Option("--list", help="List the scripts only.")] = False,
    script_args: Annotated[
        list[str] | None, typer.Argument(help="After --: arguments for every script.")
    ] = None,
    as_json: JsonOpt = False,
    target: TargetOpt = None,
    token: TokenOpt = None,
    ca_cert: CaOpt = None,
) -> None:
    """Run the benchmarks in bench/ with progress bars and print their tables (--json: one
    document with each script's exit code, seconds and output)."""
    folder = bench_dir or default_bench_dir()
    if not folder.is_dir():
        if bench_dir is None:
            raise fail(
                f"no bench/ folder at {folder}: the benchmarks ship with the source "
                "repository, not with an installed package; run from a clone, or give "
                "--bench-dir",
                code=2,
            )
        raise fail(f"--bench-dir {folder}: no such folder", code=2)
    scripts = find_benchmarks(folder, only)
    if not scripts:
        wanted = f" named {', '.join(only)}" if only else ""
        raise fail(f"no benchmark scripts{wanted} in {folder}", code=2)
    if list_only:
        if as_json:
            print_json([p.stem for p in scripts])
        elif to_terminal():
            for script in scripts:
                console.print(script.stem, highlight=False)
        else:
            print_tsv(("script",), [(p.stem,) for p in scripts])
        return
    if as_json:
        _bench_json(scripts, script_args or [], _bench_env(target, token, ca_cert), timeout)
        return
    failed: list[str] = []
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        overall = progress.add_task("benchmarks", total=len(scripts))
        for script in scripts:
            progress.update(overall, description=f"running [bold]{script.stem}[/]")
            started = time.monotonic()
            rc, out, err = _run_script(
                [script, *(script_args or [])], _bench_env(target, token, ca_cert), timeout
            )
            seconds = time.monotonic() - started
            status = "[green]ok[/]" if rc == 0 else f"[red]failed ({rc})[/]"
            progress.console.rule(f"{script.stem} · {status} · {seconds:.1f}s")
            progress.console.out(out.rstrip() or "(no output)", highlight=False)
            if rc != 0:
                failed.append(script.stem)
                progress.console.out(err.strip()[-2000:], highlight=False)
            progress.advance(overall)
        progress.update(overall, description="benchmarks done")
    if failed:
        raise fail(f"failed: {', '.join(failed)}")


def _bench_json(scripts: list[Path], args: list[str], env: dict[str, str], timeout: float) -> None:
    """Run every script without progress bars and print one JSON document of the results;
    exit 1 when one failed."""
    results = []
    for script in scripts:
        started = time.monotonic()
        rc, out, err = _run_script([script, *args], env, timeout)
        results.append({"script": script.stem, "exit_code": rc,
                        "seconds": round(time.monotonic() - started, 3),
                        "stdout": out, "stderr": err[-2000:] if rc else ""})  # fmt: skip
    print_json({"results": results})
    if any(r["exit_code"] != 0 for r in results):
        raise typer.Exit(1)


def _run_script(argv: list[Any], env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """Run one bench script from the repository root: (exit code, stdout, stderr)."""
    script: Path = argv[0]
    cmd = [sys.executable, *map(str, argv)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=script.parent.parent, check=False)  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else ""
        return -1, out, f"timed out after {timeout:.0f}s"
    return proc.returncode, proc.stdout, proc.stderr
