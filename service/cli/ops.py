"""Operator commands of the ``embcache`` CLI: stats, ls, evict, sessions and drop-session
(here), put, get (``tensors.py``) and bench (``bench.py``).

Each takes only its own flags plus ``--target``, ``--token`` and ``--ca-cert``
(``target.py``: one address for both planes) and ``--json``. Tables are for terminals;
piped, each prints a header line and one tab-separated record a line (``output.py``).
"""

# No ``from __future__ import annotations`` here: typer reads the Annotated[...] metadata.
import enum
from typing import Annotated, Any
from urllib.parse import quote

import typer
from rich.table import Table

from embcache.service.cli.output import (
    JsonOpt,
    compact_table,
    console,
    err_console,
    fail,
    fit_column,
    flatten,
    print_json,
    print_tsv,
    short_column,
    to_terminal,
)
from embcache.service.cli.target import CaOpt, Daemon, TargetOpt, TokenOpt
from embcache.service.sizes import format_size, parse_size
from embcache.service.text import plural


class State(enum.StrEnum):
    ready = "ready"
    filling = "filling"
    leased = "leased"


class Tier(enum.StrEnum):
    host = "host"
    device = "device"


class Sort(enum.StrEnum):
    none = "none"
    size = "size"
    recent = "recent"
    idle = "idle"


LS_COLUMNS = ("key", "state", "dtype", "shape", "nbytes", "runs", "leases", "idle_s", "tiers")
SESSION_COLUMNS = ("session", "transport", "client", "pid", "leases", "leased_bytes", "calls",
                   "age_s")  # fmt: skip


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
            ("", f"{plural(pool['total_pages'], 'page')} of {format_size(pool['page_bytes'])}",
             f"{plural(pool['free_runs'], 'free run')}, "
             f"largest {pool['largest_free_run_pages']:,}"),
        ]  # fmt: skip
    runs = ", ".join(f"{k}: {v}" for k, v in sorted(s["runs_per_entry"].items()))
    hits, misses = s["hits"], s["misses"]
    rows += [
        ("entries", f"{s['entries_ready']:,} ready", f"{s['entries_filling']} filling"),
        ("runs per entry", runs or "-", ""),
        ("hit rate", _pct(hits, hits + misses),
         f"{plural(hits, 'hit')}, {plural(misses, 'miss', 'misses')}"),
        ("evictions", f"{s['evictions']:,}", format_size(s["evicted_bytes"])),
        ("puts", f"{s['puts_committed']:,}",
         f"{format_size(s['put_bytes'])}, {s['puts_aborted']} aborted"),
        ("leases", f"{s['leases_active']:,} active",
         f"{plural(s['lease_owners'], 'owner')}, {s['leases_expired']:,} expired"),
    ]  # fmt: skip
    rows += [(f"copied {d}", format_size(int(n)), "") for d, n in sorted(s["bytes_copied"].items())]
    rows.append(("state", "draining" if s["draining"] else "serving", ""))
    if "version" in s:
        rows.append(("version", s["version"], f"commit {s.get('commit', 'unknown')}"))
    for row in rows:
        table.add_row(*row)
    return table


def stats(
    as_json: JsonOpt = False,
    target: TargetOpt = None,
    token: TokenOpt = None,
    ca_cert: CaOpt = None,
) -> None:
    """Show pool usage, hit rate, evictions and leases of a running daemon (piped: one
    ``name<TAB>value`` line per number, e.g. ``host.used_bytes``)."""
    body = Daemon.of(target, token, ca_cert).request("GET", "/v1/stats")
    if as_json:
        print_json(body)
    elif to_terminal():
        console.print(stats_table(body))
    else:
        print_tsv(("name", "value"), flatten(body))


def ls(
    state: Annotated[State | None, typer.Option(help="Only entries in this state.")] = None,
    tier: Annotated[Tier | None, typer.Option(help="Only entries with a copy there.")] = None,
    sort: Annotated[Sort, typer.Option(help="Order (none: the engine's).")] = Sort.none,
    limit: Annotated[int, typer.Option(min=1, max=1000, help="Entries to show.")] = 50,
    offset: Annotated[int, typer.Option(min=0, help="Entries to skip.")] = 0,
    as_json: JsonOpt = False,
    target: TargetOpt = None,
    token: TokenOpt = None,
    ca_cert: CaOpt = None,
) -> None:
    """List cached entries (paged): a table on a terminal, else a header line and one
    tab-separated line per entry (key, state, dtype, shape, nbytes, runs, leases, idle_s,
    tiers)."""
    params: dict[str, Any] = {"limit": limit, "offset": offset, "sort": sort.value}
    params.update({k: v.value for k, v in (("state", state), ("tier", tier)) if v})
    flags = {name: f"--{name}" for name in ("limit", "offset", "sort", "state", "tier")}
    page = Daemon.of(target, token, ca_cert).request("GET", "/v1/entries", flags, params=params)
    if as_json:
        print_json(page)
    elif to_terminal():
        console.print(entries_table(page))
    else:  # piped: one record a line, nothing wrapped or cut
        rows = [(e["key"], e["state"], e["dtype"], "x".join(map(str, e["shape"])), e["nbytes"],
                 e["num_runs"], e["leases"], e["idle_s"], e["residency"])
                for e in page["items"]]  # fmt: skip
        print_tsv(LS_COLUMNS, rows)


def entries_table(page: dict[str, Any], width: int | None = None) -> Table:
    """A page of entries as a table for people: only the key folds (and a long tier list
    between its tiers); short fields keep their width."""
    rows = [
        (e["key"], e["state"], e["dtype"], "x".join(map(str, e["shape"])), format_size(e["nbytes"]),
         str(e["num_runs"]), str(e["leases"]), f"{e['idle_s']:.0f}s", " ".join(e["residency"]))
        for e in page["items"]
    ]  # fmt: skip
    table = compact_table(
        caption=f"{len(page['items'])} shown of {page['total']:,} (offset {page['offset']})",
        caption_justify="left",
    )
    table.add_column("key", overflow="fold")
    names = ("state", "dtype", "shape", "size", "runs", "leases", "idle")
    for i, name in enumerate(names, start=1):
        short_column(
            table, name, [r[i] for r in rows], right=name in ("size", "runs", "leases", "idle")
        )
    tiers = [t for e in page["items"] for t in e["residency"]]
    table.add_column("tiers", min_width=max([5, *map(len, tiers)]))  # wraps between tiers
    for row in rows:
        table.add_row(*row)
    fit_column(table, 0, width or console.width, max([3, *(len(r[0]) for r in rows)]))
    return table


def evict(
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
    as_json: JsonOpt = False,
    target: TargetOpt = None,
    token: TokenOpt = None,
    ca_cert: CaOpt = None,
) -> None:
    """Evict entries by key (leased ones are refused), or free bytes by LRU; with
    --device-pool, only one GPU's copies. Exit 1 when a key was leased or not found; piped,
    one ``key<TAB>result`` line per key (the freed total goes to stderr)."""
    if bool(keys) == (free is not None):
        raise fail("give keys or --free SIZE (not both)", code=2)
    body: dict[str, Any] = {"keys": keys}
    if free is not None:
        try:
            body = {"bytes": parse_size(free)}
        except ValueError as exc:
            raise fail(f"Invalid value for '--free': {exc}", code=2) from None
    if device_pool is not None:
        body["device"] = device_pool
    flags = {"bytes": "--free", "device": "--device-pool", "keys": "KEYS"}
    out = Daemon.of(target, token, ca_cert).request("POST", "/v1/evict", flags, json=body)
    freed = f"freed {plural(out['freed_entries'], 'entry')}, {format_size(out['freed_bytes'])}"
    if as_json:
        print_json(out)
    elif to_terminal():
        for key in out["evicted"]:
            console.print(f"[green]evicted[/]   {key}", highlight=False)
        for key in out["leased"]:
            console.print(f"[yellow]leased[/]    {key} (not evicted)", highlight=False)
        for key in out["not_found"]:
            console.print(f"[red]not found[/] {key}", highlight=False)
        console.print(freed, highlight=False)
    else:
        print_tsv(("key", "result"), [(k, result) for result in ("evicted", "leased", "not_found")
                                       for k in out[result]])  # fmt: skip
        err_console.print(freed, highlight=False)
    if out["leased"] or out["not_found"]:
        raise typer.Exit(1)


# -- sessions ----------------------------------------------------------------------------
def sessions(
    as_json: JsonOpt = False,
    target: TargetOpt = None,
    token: TokenOpt = None,
    ca_cert: CaOpt = None,
) -> None:
    """List the open sessions: client, pid, leases and leased bytes, calls in flight, age."""
    body = Daemon.of(target, token, ca_cert).request("GET", "/v1/sessions")
    if as_json:
        print_json(body)
    elif to_terminal():
        console.print(sessions_table(body))
    else:
        rows = [(s["session_id"], s["transport"], s["client_name"], s["pid"], s["leases"],
                 s["leased_bytes"], s["calls_in_flight"], s["age_s"])
                for s in body["sessions"]]  # fmt: skip
        print_tsv(SESSION_COLUMNS, rows)


def sessions_table(body: dict[str, Any], width: int | None = None) -> Table:
    """The sessions document (``GET /v1/sessions``) as a table for people: the client's name
    folds; short fields keep their width."""
    rows = [
        (s["session_id"], s["transport"], s["client_name"] or "-", str(s["pid"] or "-"),
         str(s["leases"]), format_size(s["leased_bytes"]), str(s["calls_in_flight"]),
         f"{s['age_s']:.0f}s")
        for s in body["sessions"]
    ]  # fmt: skip
    table = compact_table(caption=plural(len(rows), "session"), caption_justify="left")
    short_column(table, "session", [r[0] for r in rows])
    short_column(table, "transport", [r[1] for r in rows])
    table.add_column("client", overflow="fold")
    for i, name in enumerate(("pid", "leases", "leased", "calls", "age"), start=3):
        short_column(table, name, [r[i] for r in rows], right=True)
    for row in rows:
        table.add_row(*row)
    fit_column(table, 2, width or console.width, max([6, *(len(r[2]) for r in rows)]))
    return table


def drop_session(
    session_id: Annotated[str, typer.Argument(help="A session id, as `sessions` lists it.")],
    as_json: JsonOpt = False,
    target: TargetOpt = None,
    token: TokenOpt = None,
    ca_cert: CaOpt = None,
) -> None:
    """End a session: its leases end and its stream or connection closes (the client opens a
    new session on its next call)."""
    path = f"/v1/sessions/{quote(session_id, safe='')}"
    out = Daemon.of(target, token, ca_cert).request("DELETE", path)
    if as_json:
        print_json({"session_id": session_id, **out})
    elif to_terminal():
        ended = plural(out["leases_ended"], "lease")
        console.print(f"dropped {session_id}: {ended} ended", highlight=False)
    else:
        print_tsv(("session", "leases_ended"), [(session_id, out["leases_ended"])])


def register(app: typer.Typer) -> None:
    """Add the operator commands to the ``embcache`` typer app."""
    from embcache.service.cli.bench import bench
    from embcache.service.cli.tensors import get, put

    for func in (stats, ls, evict, sessions, put, get, bench):
        app.command(func.__name__)(func)
    app.command("drop-session")(drop_session)


__all__ = ["register", "sessions_table", "stats_table"]
