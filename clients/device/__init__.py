"""The daemon's memory as this process sees it, one set per process whatever the clients.

The host pool is mapped read-only from shared memory (``shm``); device pools are opened over
CUDA IPC (``pools``). Get replies become tensors over them: views where an entry is one run,
gathered copies otherwise (``host_replies``, ``device_replies``, ``gathers``, ``uva_ids``).
CUDA tensors are described to the daemon for its copies (``exports``, ``ipc_events``,
``puts``), and ``get_into`` fills the caller's memory (``into``). The GPU code here runs on
the GPU suite only; a CPU run covers what it can with CPU pools and fakes.
"""
