"""Where the operator commands write: tables and results on stdout, errors on stderr.

Every command prints one of three forms of its result: with ``--json`` the JSON document
(:func:`print_json`); on a terminal a table or a line for people; into a pipe or a file
tab-separated records led by a header line (:func:`print_tsv`), raw numbers, nothing cut
or wrapped, so ``cut``, ``awk`` and spreadsheets read them.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from typing import Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table

console = Console()
err_console = Console(stderr=True, soft_wrap=True)  # one message, one line (never cut)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON.")]
_TSV_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print ``message`` as an error; the exit to raise (``raise fail(...)``)."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    return typer.Exit(code)


def compact_table(**options: Any) -> Table:
    """A table for a terminal: a rule under the header, two spaces between columns, no
    borders, so a listing fits 80 columns."""
    return Table(box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False, **options)


def short_column(table: Table, name: str, values: Sequence[str], right: bool = False) -> None:
    """A column of short values (a dtype, a size) that never wraps: as wide as its widest."""
    width = max([len(name), *map(len, values)])
    table.add_column(name, justify="right" if right else "left", no_wrap=True, min_width=width)


def fit_column(table: Table, index: int, width: int, longest: int) -> None:
    """Give column ``index`` what the others leave of ``width`` (a space each side of a column;
    at least 10, at most ``longest``), so it folds instead of squeezing short fields."""
    others = sum(c.min_width or 0 for i, c in enumerate(table.columns) if i != index)
    room = width - others - 2 * len(table.columns)  # a space each side of a column
    table.columns[index].width = max(10, min(room, longest))


def to_terminal() -> bool:
    """Whether stdout is a terminal (tables) rather than a pipe or a file (TSV)."""
    return console.is_terminal


def print_json(data: Any) -> None:
    """``data`` as indented JSON on stdout: plain text, never wrapped or coloured."""
    sys.stdout.write(json.dumps(data, indent=2) + "\n")
    sys.stdout.flush()


def tsv_field(value: Any) -> str:
    """One TSV field: ``None`` is empty, lists are comma-joined, and a tab, newline or
    backslash inside a value is escaped (``\\t``, ``\\n``, ``\\\\``) so a record is one line."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return ",".join(tsv_field(v) for v in value)
    return str(value).translate(_TSV_ESCAPES)


def print_tsv(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """A header line, then one tab-separated record a line, on stdout."""
    lines = ["\t".join(header)]
    lines += ["\t".join(tsv_field(v) for v in row) for row in rows]
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()


def flatten(doc: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """A nested JSON document as ``(dotted.name, value)`` pairs (list items by index)."""
    if isinstance(doc, dict):
        items: Iterable[tuple[Any, Any]] = doc.items()
    elif isinstance(doc, list) and doc and all(isinstance(v, dict | list) for v in doc):
        items = enumerate(doc)
    else:
        return [(prefix, doc)]
    out: list[tuple[str, Any]] = []
    for key, value in items:
        out += flatten(value, f"{prefix}.{key}" if prefix else str(key))
    return out
