"""Operator commands of the ``embcache`` CLI: stats, ls, evict, sessions, drop-session, put,
get, bench.

Each command talks to a running daemon found through the same settings as ``serve``
(``--http-port``, ``--grpc-port``, ``--grpc-socket``, ``--auth-token``, env ``EMBCACHE_*``):
the operator commands use the REST API, ``put``/``get`` the gRPC client library.
"""

# No ``from __future__ import annotations`` here: typer reads the Annotated[...] metadata
# through the signature that ``with_settings`` rebuilds, which must hold real objects.
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote

import httpx
import typer
from rich.table import Table

from embcache.errors import EmbCacheError
from embcache.service.cli.output import console, fail
from embcache.service.cli.settings import with_settings
from embcache.service.config import Settings
from embcache.service.sizes import format_size, parse_size

_WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]"}


# -- talking to the daemon -----------------------------------------------------------------
def http_base_url(settings: Settings) -> str:
    """The daemon's REST base URL from its settings (a wildcard bind means loopback)."""
    host = settings.http_host
    host = "127.0.0.1" if host in _WILDCARD_HOSTS else host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    scheme = "https" if settings.tls_cert else "http"
    return f"{scheme}://{host}:{settings.http_port}"


def _request(settings: Settings, method: str, path: str, **kwargs: Any) -> Any:
    """One REST call; exits with a readable message on connection or API errors."""
    headers = {"Authorization": f"Bearer {settings.auth_token}"} if settings.auth_token else {}
    verify: bool | str = str(settings.tls_cert) if settings.tls_cert else True
    url = http_base_url(settings)
    try:
        with httpx.Client(base_url=url, headers=headers, verify=verify, timeout=30) as client:
            resp = client.request(method, path, **kwargs)
    except httpx.HTTPError as exc:
        raise fail(f"cannot reach the daemon at {url}: {exc}") from None
    if resp.status_code >= 400:
        try:
            body = resp.json()
            detail = f"{body.get('error', 'error')}: {body.get('message', resp.text)}"
        except ValueError:
            detail = resp.text
        raise fail(f"{method} {path} -> {resp.status_code} {detail}")
    return resp.json()


def _grpc_client(settings: Settings) -> Any:
    try:
        from embcache.clients import EmbCacheClient
    except ImportError as exc:
        raise fail(
            f"put/get need the gRPC client (embcache.clients.EmbCacheClient): {exc}", code=2
        ) from None
    if settings.grpc_socket is not None:
        target = f"unix:{settings.grpc_socket}"
    else:
        host = "127.0.0.1" if settings.grpc_host in _WILDCARD_HOSTS else settings.grpc_host
        target = f"{host}:{settings.grpc_port}"
    roots = settings.tls_cert.read_bytes() if settings.tls_cert else None
    return EmbCacheClient(
        target,
        token=settings.auth_token,
        timeout=30.0,
        retries=1,
        root_certificates=roots,
        client_name="embcache-cli",
    )


@contextlib.contextmanager
def _rpc_errors(what: str) -> Iterator[None]:
    """Turn client errors (typed engine errors, failed RPCs) into one readable line."""
    try:
        yield
    except EmbCacheError as exc:
        raise fail(f"{what}: {type(exc).__name__}: {exc}") from None


# -- stats / ls / evict ------------------------------------------------------------------
def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def stats_table(s: dict[str, Any]) -> Table:
    """The stats document (``GET /v1/stats``) as a table for people."""
    table = Table(title="embcache", show_header=False, title_justify="left", box=None)
    table.add_column(style="bold cyan")
    table.add_column(justify="right")
    table.add_column(style="dim")
    rows: list[tuple[str, str, str]] = []
    for pool in [s["host"], *s["device"]]:
        used, cap = pool["used_bytes"], pool["capacity_bytes"]
        rows += [
            (f"{pool['tier']} pool", f"{format_size(used)} / {format_size(cap)}", _pct(used, cap)),
            ("", f"{pool['total_pages']:,} pages of {format_size(pool['page_bytes'])}",
             f"{pool['free_runs']} free runs, largest {pool['largest_free_run_pages']:,}"),
        ]  # fmt: skip
    runs = ", ".join(f"{k}: {v}" for k, v in sorted(s["runs_per_entry"].items()))
    hits, misses = s["hits"], s["misses"]
    rows += [
        ("entries", f"{s['entries_ready']:,} ready", f"{s['entries_filling']} filling"),
        ("runs per entry", runs or "-", ""),
        ("hit rate", _pct(hits, hits + misses), f"{hits:,} hits, {misses:,} misses"),
        ("evictions", f"{s['evictions']:,}", format_size(s["evicted_bytes"])),
        ("puts", f"{s['puts_committed']:,}",
         f"{format_size(s['put_bytes'])}, {s['puts_aborted']} aborted"),
        ("leases", f"{s['leases_active']:,} active",
         f"{s['lease_owners']} owners, {s['leases_expired']:,} expired"),
    ]  # fmt: skip
    rows += [(f"copied {d}", format_size(int(n)), "") for d, n in sorted(s["bytes_copied"].items())]
    rows.append(("state", "draining" if s["draining"] else "serving", ""))
    for row in rows:
        table.add_row(*row)
    return table


@with_settings
def stats(
    settings: Settings,
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw JSON.")] = False,
) -> None:
    """Show pool usage, hit rate, evictions and leases of a running daemon."""
    body = _request(settings, "GET", "/v1/stats")
    if as_json:
        console.print_json(data=body)
    else:
        console.print(stats_table(body))


@with_settings
def ls(
    settings: Settings,
    state: Annotated[str | None, typer.Option(help="ready, filling or leased.")] = None,
    tier: Annotated[str | None, typer.Option(help="host or device.")] = None,
    sort: Annotated[str, typer.Option(help="none, size, recent or idle.")] = "none",
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 50,
    offset: Annotated[int, typer.Option(min=0)] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw JSON.")] = False,
) -> None:
    """List cached entries (paged)."""
    params: dict[str, Any] = {"limit": limit, "offset": offset, "sort": sort}
    params.update({k: v for k, v in (("state", state), ("tier", tier)) if v})
    page = _request(settings, "GET", "/v1/entries", params=params)
    if as_json:
        console.print_json(data=page)
        return
    table = Table(
        caption=f"{len(page['items'])} shown of {page['total']:,} (offset {page['offset']})",
        caption_justify="left",
    )
    for name in ("key", "state", "dtype", "shape", "size", "runs", "leases", "idle", "tiers"):
        right = name in ("size", "runs", "leases", "idle")
        table.add_column(name, justify="right" if right else "left", overflow="fold")
    for e in page["items"]:
        table.add_row(
            e["key"],
            e["state"],
            e["dtype"],
            "x".join(map(str, e["shape"])),
            format_size(e["nbytes"]),
            str(e["num_runs"]),
            str(e["leases"]),
            f"{e['idle_s']:.0f}s",
            ",".join(e["residency"]),
        )
    console.print(table)


@with_settings
def evict(
    settings: Settings,
    keys: Annotated[list[str] | None, typer.Argument(help="Keys to evict.")] = None,
    free: Annotated[
        str | None,
        typer.Option("--free", help="Instead of keys: free this many bytes by LRU (e.g. 1GiB)."),
    ] = None,
    device_pool: Annotated[
        int | None,
        typer.Option(
            "--device-pool",
            min=0,
            help="Only the copies in this device pool, by index (host copies stay).",
        ),
    ] = None,
) -> None:
    """Evict entries by key (leased ones are refused), or free bytes by LRU; with
    --device-pool, only one GPU's copies."""
    if bool(keys) == (free is not None):
        raise fail("give keys or --free SIZE (not both)", code=2)
    body: dict[str, Any] = {"keys": keys}
    if free is not None:
        try:
            body = {"bytes": parse_size(free)}
        except ValueError as exc:
            raise fail(str(exc), code=2) from None
    if device_pool is not None:
        body["device"] = device_pool
    out = _request(settings, "POST", "/v1/evict", json=body)
    for key in out["evicted"]:
        console.print(f"[green]evicted[/]   {key}", highlight=False)
    for key in out["leased"]:
        console.print(f"[yellow]leased[/]    {key} (not evicted)", highlight=False)
    for key in out["not_found"]:
        console.print(f"[red]not found[/] {key}", highlight=False)
    console.print(f"freed {out['freed_entries']} entries, {format_size(out['freed_bytes'])}")
    if out["leased"] or out["not_found"]:
        raise typer.Exit(1)


# -- sessions ----------------------------------------------------------------------------
@with_settings
def sessions(
    settings: Settings,
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw JSON.")] = False,
) -> None:
    """List the open sessions: client, pid, leases and leased bytes, calls in flight, age."""
    body = _request(settings, "GET", "/v1/sessions")
    if as_json:
        console.print_json(data=body)
        return
    table = Table(caption=f"{len(body['sessions'])} sessions", caption_justify="left")
    for name in ("session", "transport", "client", "pid", "leases", "leased", "calls", "age"):
        right = name in ("pid", "leases", "leased", "calls", "age")
        table.add_column(name, justify="right" if right else "left", overflow="fold")
    for s in body["sessions"]:
        table.add_row(
            s["session_id"],
            s["transport"],
            s["client_name"] or "-",
            str(s["pid"] or "-"),
            str(s["leases"]),
            format_size(s["leased_bytes"]),
            str(s["calls_in_flight"]),
            f"{s['age_s']:.0f}s",
        )
    console.print(table)


@with_settings
def drop_session(
    settings: Settings,
    session_id: Annotated[str, typer.Argument(help="A session id, as `sessions` lists it.")],
) -> None:
    """End a session: its leases end and its stream or connection closes (the client opens a
    new session on its next call)."""
    out = _request(settings, "DELETE", f"/v1/sessions/{quote(session_id, safe='')}")
    console.print(f"dropped {session_id}: {out['leases_ended']} leases ended", highlight=False)


# -- put / get ----------------------------------------------------------------------------
def load_tensor(path: Path, name: str | None) -> Any:
    """A CPU tensor from ``.npy`` or ``.safetensors`` (``name`` picks one of several)."""
    import numpy as np
    import torch

    suffix = path.suffix.lower()
    if suffix == ".npy":
        return torch.from_numpy(np.load(path, allow_pickle=False))
    if suffix == ".safetensors":
        from safetensors.torch import load_file

        tensors = load_file(str(path))
        if name is None and len(tensors) == 1:
            return next(iter(tensors.values()))
        if name not in tensors:
            raise ValueError(f"{path} holds tensors {sorted(tensors)}; pick one with --tensor")
        return tensors[name]
    raise ValueError(f"unsupported file type {suffix!r}: use .npy or .safetensors")


def save_tensor(tensor: Any, path: Path, name: str) -> None:
    """Write ``tensor`` as ``.npy`` or ``.safetensors`` (under ``name``); ValueError else."""
    suffix = path.suffix.lower()
    if suffix == ".npy":
        import numpy as np

        try:
            np.save(path, tensor.cpu().numpy(), allow_pickle=False)
        except TypeError as exc:  # e.g. bfloat16 has no numpy equivalent
            raise ValueError(f"{exc}; save as .safetensors instead") from None
    elif suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({name: tensor.cpu().contiguous()}, str(path))
    else:
        raise ValueError(f"unsupported file type {suffix!r}: use .npy or .safetensors")


TensorOpt = Annotated[str | None, typer.Option("--tensor", help="Tensor name in a .safetensors.")]


@with_settings
def put(
    settings: Settings,
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help=".npy/.safetensors")],
    key: Annotated[str, typer.Argument(help="Cache key.")],
    tensor: TensorOpt = None,
) -> None:
    """Store a tensor from a file under KEY (for debugging)."""
    try:
        value = load_tensor(file, tensor)
    except (ValueError, OSError) as exc:
        raise fail(str(exc), code=2) from None
    with _grpc_client(settings) as client, _rpc_errors(f"put {key!r}"):
        created = client.put(key, value)
    verb = "stored" if created else "already present:"
    console.print(
        f"{verb} {key} {str(value.dtype).removeprefix('torch.')} "
        f"{list(value.shape)} ({format_size(value.numel() * value.element_size())})",
        highlight=False,
    )


@with_settings
def get(
    settings: Settings,
    key: Annotated[str, typer.Argument(help="Cache key.")],
    file: Annotated[Path, typer.Argument(dir_okay=False, help="Output .npy/.safetensors")],
    tensor: TensorOpt = None,
) -> None:
    """Fetch the entry KEY into a file (for debugging)."""
    if file.suffix.lower() not in (".npy", ".safetensors"):
        raise fail(f"unsupported file type {file.suffix!r}: use .npy or .safetensors", code=2)
    with _grpc_client(settings) as client, _rpc_errors(f"get {key!r}"):
        entry = client.get_bytes(key)
    if entry is None:
        raise fail(f"no entry {key!r}")
    value = entry.tensor()
    try:
        save_tensor(value, file, tensor or "embedding")
    except (ValueError, OSError) as exc:
        raise fail(str(exc)) from None
    console.print(f"wrote {file} {list(value.shape)}", highlight=False)


def register(app: typer.Typer) -> None:
    """Add the operator commands to the ``embcache`` typer app."""
    from embcache.service.cli.bench import bench

    for func in (stats, ls, evict, sessions, put, get, bench):
        app.command(func.__name__)(func)
    app.command("drop-session")(drop_session)


__all__ = ["http_base_url", "load_tensor", "register", "save_tensor"]
