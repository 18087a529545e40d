"""``python -m embcache.integrations.sglang.launch <sglang server args>``: SGLang's server
with the ``embcache`` multimodal embedding store selectable from its command line.

SGLang 0.5.23 lets ``--mm-global-cache-backend`` name only ``mooncake`` (a fixed list of
choices), although its ``EmbeddingStoreFactory`` builds any registered backend. This
launcher loads SGLang's plugins, registers ``embcache``, takes
``--mm-global-cache-backend embcache`` out of the arguments before SGLang parses them,
sets it on the parsed server arguments, and runs SGLang's own server entry point
(``sglang.launch_server.run_server``) with them, as ``python -m sglang.launch_server`` does.
Every other argument, ``--help`` included, is SGLang's.

The processes SGLang starts register the backend through the ``sglang.srt.plugins``
entry point, so embcache must be installed (not only on ``PYTHONPATH``) where they run.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from embcache.integrations.sglang import BACKEND_NAME, register

FLAG = "--mm-global-cache-backend"


def split_backend(argv: Sequence[str]) -> tuple[list[str], str | None]:
    """``argv`` without ``--mm-global-cache-backend embcache`` (either spelling), and the
    backend it named (None: not given, or another backend, which SGLang parses itself).

    Raises:
        SystemExit: the flag is last, with no value.
    """
    out: list[str] = []
    backend: str | None = None
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == FLAG:
            if i + 1 >= len(args):
                raise SystemExit(f"{FLAG} needs a value")
            value = args[i + 1]
            if value == BACKEND_NAME:
                backend = value
            else:
                out += [arg, value]
            i += 2
            continue
        if arg.startswith(FLAG + "="):
            value = arg.split("=", 1)[1]
            if value == BACKEND_NAME:
                backend = value
            else:
                out.append(arg)
            i += 1
            continue
        out.append(arg)
        i += 1
    return out, backend


def prepare(argv: Sequence[str]) -> Any:
    """SGLang's server arguments for ``argv``, with the embcache backend where it is named.

    Loads SGLang's plugins and registers the backend in this process first.
    """
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    register()
    rest, backend = split_backend(argv)
    server_args = prepare_server_args(rest)
    if backend is not None:
        server_args.mm_global_cache_backend = backend
    return server_args


def main(argv: Sequence[str] | None = None, run: Callable[[Any], Any] | None = None) -> None:
    """Parse ``argv`` (default: the command line) and run SGLang's server with it.

    Args:
        argv: SGLang server arguments.
        run: the server entry point (default ``sglang.launch_server.run_server``).
    """
    server_args = prepare(sys.argv[1:] if argv is None else argv)
    if run is None:
        from sglang.launch_server import run_server

        run = run_server
    try:
        run(server_args)
    finally:
        # As SGLang's own launcher: the server's child processes end with it.
        from sglang.srt.utils import kill_process_tree

        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
