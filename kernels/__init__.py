"""GPU ops of embcache, each with a pure-torch reference that is its spec.

Importing this package never imports triton; the Triton kernels load on first use, so CPU-only
code (clients, CI without a GPU) can import it. It imports nothing from the service either.
"""

from embcache.kernels._cudart import CudaRuntime, CudaRuntimeError, StreamEvent
from embcache.kernels._cudart import runtime as cuda_runtime
from embcache.kernels._env import current_raw_stream, current_stream_idle, on_device
from embcache.kernels.host_memory import (
    HostRegistration,
    register_host_memory,
    register_host_range,
)
from embcache.kernels.host_runs import copy_to_host_runs, queue_to_host_runs
from embcache.kernels.page_table import (
    alloc_bind_inplace,
    alloc_bind_inplace_reference,
    bind_inplace,
    bind_inplace_reference,
    free_unbind_inplace,
    free_unbind_inplace_reference,
)
from embcache.kernels.read_table import build_read_table, build_read_table_reference
from embcache.kernels.transfer import (
    TransferConfig,
    choose_backend,
    transfer_planned,
    transfer_ranges,
    transfer_ranges_reference,
)

__all__ = [
    "CudaRuntime",
    "CudaRuntimeError",
    "HostRegistration",
    "StreamEvent",
    "TransferConfig",
    "alloc_bind_inplace",
    "alloc_bind_inplace_reference",
    "bind_inplace",
    "bind_inplace_reference",
    "build_read_table",
    "build_read_table_reference",
    "choose_backend",
    "copy_to_host_runs",
    "cuda_runtime",
    "current_raw_stream",
    "current_stream_idle",
    "free_unbind_inplace",
    "free_unbind_inplace_reference",
    "on_device",
    "queue_to_host_runs",
    "register_host_memory",
    "register_host_range",
    "transfer_planned",
    "transfer_ranges",
    "transfer_ranges_reference",
]
