"""``embcache put`` and ``get``: tensors between files and the daemon, over gRPC."""

# No ``from __future__ import annotations``: typer reads the Annotated[...] metadata.
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from embcache.errors import EmbCacheError
from embcache.service.cli.output import (
    JsonOpt,
    console,
    fail,
    print_json,
    print_tsv,
    to_terminal,
)
from embcache.service.cli.target import CaOpt, Daemon, TargetOpt, TokenOpt
from embcache.service.sizes import format_size

SUFFIXES = (".npy", ".safetensors")


def load_tensor(path: Path, name: str | None) -> Any:
    """A CPU tensor from ``.npy`` or ``.safetensors`` (``name`` picks one of several);
    ValueError saying what is wrong with the file."""
    import numpy as np
    import torch

    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ValueError(f"unsupported file type {suffix!r}: use .npy or .safetensors")
    if suffix == ".npy":
        if name is not None:
            raise ValueError("--tensor picks a tensor of a .safetensors file; a .npy holds one")
        try:
            return torch.from_numpy(np.load(path, allow_pickle=False))
        except (ValueError, OSError, EOFError):  # numpy's own words talk of pickles
            raise ValueError(
                f"{path} is not a .npy array file (or holds Python objects, never loaded)"
            ) from None
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except Exception as exc:  # SafetensorError and friends carry no common base
        raise ValueError(f"{path} is not a .safetensors file ({exc})") from None
    if name is None:
        if len(tensors) == 1:
            return next(iter(tensors.values()))
        raise ValueError(f"{path} holds tensors {sorted(tensors)}; pick one with --tensor")
    if name not in tensors:
        raise ValueError(f"{path} has no tensor {name!r}; it holds {sorted(tensors)}")
    return tensors[name]


def save_tensor(tensor: Any, path: Path, name: str) -> None:
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


def _grpc_client(daemon: Daemon) -> Any:
    """A client on the daemon's gRPC plane (its port asked from the HTTP plane first, so a
    daemon that is down fails at once, with the same message as the REST commands)."""
    target = daemon.grpc_target()
    from embcache.clients import EmbCacheClient

    roots = daemon.ca_cert.read_bytes() if daemon.ca_cert else None
    return EmbCacheClient(target, token=daemon.token, timeout=30.0, retries=1,
                          root_certificates=roots, client_name="embcache-cli")  # fmt: skip


@contextlib.contextmanager
def _rpc_errors(what: str) -> Iterator[None]:
    """Turn client errors (typed engine errors, failed RPCs) into one readable line."""
    try:
        yield
    except EmbCacheError as exc:
        raise fail(f"{what}: {type(exc).__name__}: {exc}") from None


TensorOpt = Annotated[
    str | None, typer.Option("--tensor", help="Tensor name in a .safetensors file.")
]


def put(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help=".npy/.safetensors")],
    key: Annotated[str, typer.Argument(help="Cache key.")],
    tensor: TensorOpt = None,
    as_json: JsonOpt = False,
    target: TargetOpt = None,
    token: TokenOpt = None,
    ca_cert: CaOpt = None,
) -> None:
    """Store a tensor from a file under KEY (for debugging)."""
    try:
        value = load_tensor(file, tensor)
    except (ValueError, OSError) as exc:
        raise fail(str(exc), code=2) from None
    daemon = Daemon.of(target, token, ca_cert)
    with _grpc_client(daemon) as client, _rpc_errors(f"put {key!r}"):
        created = client.put(key, value)
    _report(key, "stored" if created else "present", value, None, as_json)


def get(
    key: Annotated[str, typer.Argument(help="Cache key.")],
    file: Annotated[Path, typer.Argument(dir_okay=False, help="Output .npy/.safetensors")],
    tensor: TensorOpt = None,
    as_json: JsonOpt = False,
    target: TargetOpt = None,
    token: TokenOpt = None,
    ca_cert: CaOpt = None,
) -> None:
    """Fetch the entry KEY into a file (for debugging)."""
    if file.suffix.lower() not in SUFFIXES:
        raise fail(f"unsupported file type {file.suffix!r}: use .npy or .safetensors", code=2)
    daemon = Daemon.of(target, token, ca_cert)
    with _grpc_client(daemon) as client, _rpc_errors(f"get {key!r}"):
        entry = client.get_bytes(key)
    if entry is None:
        raise fail(f"no entry {key!r}")
    value = entry.tensor()
    try:
        save_tensor(value, file, tensor or "embedding")
    except (ValueError, OSError) as exc:
        raise fail(str(exc)) from None
    _report(key, "written", value, file, as_json)


def _report(key: str, result: str, value: Any, file: Path | None, as_json: bool) -> None:
    """What ``put`` or ``get`` did, in the form stdout asks for (``output.py``)."""
    dtype = str(value.dtype).removeprefix("torch.")
    nbytes = value.numel() * value.element_size()
    doc = {"key": key, "result": result, "dtype": dtype, "shape": list(value.shape),
           "nbytes": nbytes, "file": None if file is None else str(file)}  # fmt: skip
    if as_json:
        print_json(doc)
    elif not to_terminal():
        shape = "x".join(map(str, value.shape))
        print_tsv(tuple(doc), [tuple({**doc, "shape": shape}.values())])
    elif file is not None:
        console.print(f"wrote {file} {dtype} {list(value.shape)}", highlight=False)
    else:
        verb = "stored" if result == "stored" else "already present:"
        console.print(f"{verb} {key} {dtype} {list(value.shape)} ({format_size(nbytes)})",
                      highlight=False)  # fmt: skip
