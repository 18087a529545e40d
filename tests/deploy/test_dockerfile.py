"""The Dockerfile and .dockerignore, checked without a container engine.

A small parser (continuations, comments, ARG/ENV substitution, stages) reads the
Dockerfile; the tests hold it to the packaging rules: multi-stage on a CUDA runtime base,
the project built as a wheel and installed from it, a numeric non-root user, the daemon's
default ports, a /livez health check that really works against a live daemon, and
``embcache serve`` as the entrypoint.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from embcache.service.config import Settings

_VAR = re.compile(r"\$(?:\{(\w+)\}|(\w+))")
# Instructions whose arguments the builder expands (RUN is left to the shell).
_SUBSTITUTED = {"ADD", "COPY", "ENV", "EXPOSE", "LABEL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR"}


@dataclass
class Instruction:
    keyword: str  # upper case: FROM, RUN, ...
    args: str  # the rest of the line, continuations joined, variables substituted
    line: int


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction:
        found = self.all(keyword)
        assert found, f"stage {self.name or self.base} has no {keyword}"
        return found[-1]


def _substitute(text: str, scope: dict[str, str]) -> str:
    return _VAR.sub(lambda m: scope.get(m.group(1) or m.group(2), m.group(0)), text)


def _assignments(args: str) -> dict[str, str]:
    """``A=1 B="x y"`` (ARG/ENV/LABEL) into a dict; ``ARG NAME`` alone gives ''."""
    out = {}
    for word in shlex.split(args):
        name, _, value = word.partition("=")
        out[name] = value
    return out


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages). Variables from ARG/ENV are substituted as they
    would be at build time with no --build-arg; parser directives and comments dropped."""
    logical: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue  # comments (inside continuations too) and blank lines
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        logical.append((start, " ".join(p for p in pending if p)))
        pending = []
    assert not pending, "the Dockerfile ends inside a line continuation"

    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    scope: dict[str, str] = {}
    for number, line in logical:
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            words = _substitute(rest, global_args).split()
            words = [w for w in words if not w.startswith("--platform")]
            name = words[2] if len(words) == 3 and words[1].lower() == "as" else None
            stages.append(Stage(base=words[0], name=name))
            scope = {}
            continue
        if not stages:
            assert keyword == "ARG", f"line {number}: only ARG may precede the first FROM"
            global_args.update(_assignments(rest))
            continue
        value = _substitute(rest, scope) if keyword in _SUBSTITUTED else rest
        if keyword == "ARG":
            for name, default in _assignments(rest).items():
                scope[name] = default or global_args.get(name, "")
        elif keyword == "ENV":
            scope.update(_assignments(value))
        stages[-1].instructions.append(Instruction(keyword, value, number))
    return global_args, stages


def _split_flags(args: str) -> tuple[dict[str, str], str]:
    """Leading ``--flag=value`` options of an instruction, and the rest."""
    flags = {}
    rest = args
    while rest.startswith("--"):
        word, _, rest = rest.partition(" ")
        name, _, value = word[2:].partition("=")
        flags[name] = value
        rest = rest.lstrip()
    return flags, rest


@pytest.fixture(scope="module")
def dockerfile(repo: Path) -> tuple[dict[str, str], list[Stage]]:
    return parse_dockerfile((repo / "Dockerfile").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def runtime(dockerfile: tuple[dict[str, str], list[Stage]]) -> Stage:
    return dockerfile[1][-1]


def test_parser_handles_continuations_and_variables() -> None:
    _, stages = parse_dockerfile(
        "ARG BASE=img:1\nFROM ${BASE} AS b\n# c\nARG U=7\nRUN a \\\n  # inside\n  && b\n"
        "USER ${U}:$U\n"
    )
    assert stages[0].base == "img:1" and stages[0].name == "b"
    assert stages[0].last("RUN").args == "a && b"
    assert stages[0].last("USER").args == "7:7"


def test_multi_stage_on_a_cuda_runtime_base(dockerfile: tuple[dict[str, str], list[Stage]]):
    _, stages = dockerfile
    assert len(stages) >= 2, "builder + runtime stages expected"
    cuda_runtime = re.compile(r"^nvidia/cuda:1[2-9]\.\d+(\.\d+)?-(cudnn\d*-)?runtime-ubuntu\d")
    runtime = stages[-1]
    assert cuda_runtime.match(runtime.base), f"runtime base {runtime.base!r}"
    # Same base in every stage: the wheels are built for the runtime's Python.
    assert {s.base for s in stages} == {runtime.base}
    assert all(s.name for s in stages), "name every stage (FROM ... AS name)"


def test_builder_builds_the_wheel_and_runtime_installs_it(
    dockerfile: tuple[dict[str, str], list[Stage]],
) -> None:
    _, stages = dockerfile
    builder, runtime = stages[0], stages[-1]
    builds = [i.args for i in builder.all("RUN") if "pip wheel" in i.args]
    assert builds, "the builder runs `pip wheel`"
    assert re.search(r"pip wheel\b.*\s\.(\s|$)", builds[-1]), "the wheel is built from the source"
    assert any(i.args.split()[-1] in (".", "./") for i in builder.all("COPY")), "sources copied"
    installs = [i.args for i in runtime.all("RUN") if "pip install" in i.args]
    assert installs, "the runtime stage installs with pip"
    install = installs[-1]
    flags, _ = _split_flags(install)
    from_builder = f"from={builder.name}" in flags.get("mount", "") or any(
        f"--from={builder.name}" in i.args for i in runtime.all("COPY")
    )
    assert from_builder, "the runtime takes the wheels from the builder stage"
    assert "--no-index" in install, "only the built wheels, nothing else from the index"
    assert re.search(r"--find-links[ =]\S+ embcache\b", install), "installs the embcache wheel"
    # Nothing copies the stubs in: they come from setup.py's build hook inside `pip wheel`.
    assert not runtime.all("ADD")


def test_runs_as_a_numeric_non_root_user(runtime: Stage) -> None:
    user = runtime.last("USER").args.split(":")[0]
    assert user.isdigit() and int(user) >= 1000, f"USER {user!r}: numeric, non-root"
    # Kubernetes' runAsNonRoot can only verify a numeric user; the manifests use this UID.
    entry_index = runtime.instructions.index(runtime.last("ENTRYPOINT"))
    assert runtime.instructions.index(runtime.last("USER")) < entry_index


def test_exposes_the_default_ports(runtime: Stage) -> None:
    exposed = {int(p.split("/")[0]) for i in runtime.all("EXPOSE") for p in i.args.split()}
    defaults = Settings()
    assert exposed == {defaults.grpc_port, defaults.http_port}


def test_entrypoint_is_embcache_serve(repo: Path, runtime: Stage) -> None:
    entry = json.loads(runtime.last("ENTRYPOINT").args)  # exec form: signals reach the daemon
    assert entry == ["embcache", "serve"]
    scripts = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["embcache"] == "embcache.service.cli:app"
    assert not runtime.all("CMD"), "settings come from env vars, not CMD arguments"


def test_image_env_is_valid_settings(
    runtime: Stage, settings_from_env: Callable[[dict[str, str]], Settings]
) -> None:
    env: dict[str, str] = {}
    for instruction in runtime.all("ENV"):
        env.update(_assignments(instruction.args))
    embcache = {k: v for k, v in env.items() if k.startswith("EMBCACHE_")}
    assert embcache, "the image sets its container defaults as EMBCACHE_* variables"
    # The image binds HTTP beyond loopback, so the daemon insists on a token at run time.
    with pytest.raises(ValueError, match="auth_token"):
        settings_from_env(embcache)
    settings = settings_from_env({**embcache, "EMBCACHE_AUTH_TOKEN": "t0ken"})
    assert settings.grpc_socket is not None
    assert env.get("NVIDIA_VISIBLE_DEVICES") == "all"


def _healthcheck_argv(runtime: Stage) -> list[str]:
    flags, rest = _split_flags(runtime.last("HEALTHCHECK").args)
    assert flags.get("start-period"), "a start period covers pinning the pool"
    keyword, _, command = rest.partition(" ")
    assert keyword == "CMD"
    argv = json.loads(command)  # exec form: no shell needed in the image
    assert isinstance(argv, list) and argv[0].startswith("python")
    return argv


def test_healthcheck_uses_livez_without_curl(
    runtime: Stage, serves_get: Callable[[str], bool]
) -> None:
    script = " ".join(_healthcheck_argv(runtime))
    assert "/livez" in script and serves_get("/livez")
    assert "urllib" in script and "curl" not in script
    assert f"'{Settings().http_port}'" in script, "falls back to the default HTTP port"


def test_healthcheck_passes_against_a_live_daemon_and_fails_without_one(
    runtime: Stage, live_daemon: dict[str, Any]
) -> None:
    argv = [sys.executable, *_healthcheck_argv(runtime)[1:]]
    env = {**os.environ, "EMBCACHE_HTTP_PORT": str(live_daemon["http_port"])}
    assert subprocess.run(argv, env=env, capture_output=True, timeout=30).returncode == 0
    env["EMBCACHE_HTTP_PORT"] = "1"  # nothing listens there
    assert subprocess.run(argv, env=env, capture_output=True, timeout=30).returncode != 0


# -- .dockerignore -------------------------------------------------------------------------


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """Docker's matching: ``*`` and ``?`` stay inside one path element, ``**`` spans any."""
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + "$")


def dockerignored(patterns: list[str], path: str) -> bool:
    """Whether the build context leaves ``path`` out (a pattern also covers what is below
    a matching directory; the last matching pattern wins, ``!`` re-includes)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for raw in patterns:
        negate = raw.startswith("!")
        regex = _pattern_regex(raw.lstrip("!").strip("/"))
        if any(regex.match(p) for p in prefixes):
            excluded = not negate
    return excluded


@pytest.fixture(scope="module")
def ignore_patterns(repo: Path) -> list[str]:
    lines = (repo / ".dockerignore").read_text(encoding="utf-8").splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def _wheel_sources(repo: Path) -> list[str]:
    """Every file the wheel build reads: metadata, build hook, and each package's files."""
    meta = tomllib.loads((repo / "pyproject.toml").read_text())
    wanted = ["pyproject.toml", "setup.py", meta["project"]["readme"]]
    wanted += [p.name for p in repo.glob("*.py") if p.name != "setup.py"]  # the root package
    for package in _setup_packages(repo):
        folder = repo.joinpath(*package.split(".")[1:])
        for path in folder.glob("*"):
            if path.is_file() and path.suffix in (".py", ".proto"):
                wanted.append(path.relative_to(repo).as_posix())
    static = repo / "service" / "transport" / "http" / "static"
    wanted += [p.relative_to(repo).as_posix() for p in static.rglob("*") if p.is_file()]
    return wanted


def _setup_packages(repo: Path) -> list[str]:
    """The package list setup.py hands to setuptools (it finds them on disk)."""
    spec = importlib.util.spec_from_file_location("_embcache_setup", repo / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: setup() is not called
    packages: list[str] = module._packages()
    assert "embcache.service" in packages and "embcache.clients" in packages, packages
    return packages


def test_dockerignore_matcher() -> None:
    pats = ["**/__pycache__", "*.egg-info", "tests", "proto/embcache/v1/*_pb2*.py", "!keep"]
    assert dockerignored(pats, "service/__pycache__/x.pyc")
    assert dockerignored(pats, "embcache.egg-info/PKG-INFO")
    assert dockerignored(pats, "tests/deploy/conftest.py")
    assert dockerignored(pats, "proto/embcache/v1/embcache_pb2.py")
    assert not dockerignored(pats, "proto/embcache/v1/embcache.proto")
    assert not dockerignored(pats, "proto/embcache/v1/services.py")
    assert not dockerignored(pats, "service/tests.py")


def test_dockerignore_keeps_the_build_inputs(repo: Path, ignore_patterns: list[str]) -> None:
    generated = re.compile(r"_pb2\.pyi?$")
    sources = [p for p in _wheel_sources(repo) if not generated.search(p)]
    assert "proto/codegen.py" in sources and "proto/embcache/v1/embcache.proto" in sources
    assert "proto/embcache/v1/services.py" in sources  # the gRPC stub: written, not generated
    dropped = [p for p in sources if dockerignored(ignore_patterns, p)]
    assert not dropped, f".dockerignore drops build inputs: {dropped}"


def test_dockerignore_drops_local_state_and_stale_stubs(ignore_patterns: list[str]) -> None:
    for path in (
        ".git/HEAD",
        ".venv/bin/python",
        "service/__pycache__/config.cpython-311.pyc",
        "embcache.egg-info/PKG-INFO",
        "proto/embcache/v1/embcache_pb2.py",
        "proto/embcache/v1/embcache_pb2.pyi",
        "proto/embcache/v1/embcache_pb2_grpc.py",  # no longer generated; a checkout may keep one
        "tests/conftest.py",
    ):
        assert dockerignored(ignore_patterns, path), path
