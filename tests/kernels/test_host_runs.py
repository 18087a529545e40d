"""copy_to_host_runs: one contiguous buffer into byte runs of a host buffer.

The CPU cases run everywhere; the CUDA cases (``gpu``) check every way it copies (one
``cudaMemcpyAsync`` per run, one ``cudaMemcpyBatchAsync``) against the same spec.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embcache.kernels import copy_to_host_runs, queue_to_host_runs
from embcache.kernels.host_runs import MEMCPY_MAX_RUNS

HOST = 1 << 16


def spec(src: torch.Tensor, host: torch.Tensor, runs: list[tuple[int, int]]) -> torch.Tensor:
    """What host holds afterwards: a copy of it with src's bytes laid into the runs."""
    out = host.clone()
    flat = src.reshape(-1).view(torch.uint8).cpu()
    done = 0
    for offset, count in runs:
        out[offset : offset + count] = flat[done : done + count]
        done += count
    return out


def random_runs(rng: random.Random, host_bytes: int, count: int, align: int) -> list[list[int]]:
    """``count`` disjoint runs (in shuffled order) inside ``host_bytes``."""
    cuts = sorted(rng.sample(range(0, host_bytes // align), 2 * count))
    runs = [[cuts[2 * i] * align, (cuts[2 * i + 1] - cuts[2 * i]) * align] for i in range(count)]
    rng.shuffle(runs)
    return runs


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), count=st.integers(0, 12), align=st.sampled_from([1, 4, 16]))
def test_cpu_matches_the_spec(seed: int, count: int, align: int) -> None:
    rng = random.Random(seed)
    runs = random_runs(rng, HOST, count, align) if count else []
    if runs and rng.random() < 0.3:
        runs.append([rng.randrange(HOST), 0])  # an empty run anywhere is allowed
    total = sum(n for _, n in runs)
    src = torch.randint(0, 256, (total,), dtype=torch.uint8)
    host = torch.randint(0, 256, (HOST,), dtype=torch.uint8)
    want = spec(src, host, [tuple(r) for r in runs])
    how = copy_to_host_runs(src, host, [tuple(r) for r in runs])
    assert how == ("torch" if total else "none")
    assert torch.equal(host, want)


def test_cpu_any_dtype_and_shape() -> None:
    src = torch.randn(3, 5, 7, dtype=torch.float32)
    host = torch.zeros(HOST, dtype=torch.uint8)
    runs = [(4096, 200), (100, 220)]
    copy_to_host_runs(src, host, runs)
    back = torch.cat([host[4096:4296], host[100:320]]).view(torch.float32).view(3, 5, 7)
    assert torch.equal(back, src)


BAD = [
    ("not a tensor", lambda s, h: (s.numpy(), h, [(0, 64)]), "src, host"),
    ("host on a meta device", lambda s, h: (s, h.to("meta"), [(0, 64)]), "host"),
    ("src not contiguous", lambda s, h: (s.view(8, 8).t(), h, [(0, 64)]), "contiguous"),
    ("runs not a list", lambda s, h: (s, h, {0: 64}), "runs"),
    ("run not a pair", lambda s, h: (s, h, [(0, 32, 1), (64, 32)]), "pair"),
    ("float offset", lambda s, h: (s, h, [(0.0, 64)]), "integers"),
    ("bool count", lambda s, h: (s, h, [(0, True)]), "integers"),
    ("negative offset", lambda s, h: (s, h, [(-1, 64)]), "negative"),
    ("past the end", lambda s, h: (s, h, [(HOST - 32, 64)]), "past"),
    ("too few bytes", lambda s, h: (s, h, [(0, 32)]), "64"),
    ("too many bytes", lambda s, h: (s, h, [(0, 32), (100, 64)]), "96"),
    ("overlap", lambda s, h: (s, h, [(0, 32), (16, 32)]), "overlap"),
    ("aliasing", lambda s, h: (h[:64], h, [(32, 64)]), "shares memory"),
    ("stream for a CPU src", lambda s, h: (s, h, [(0, 64)], "stream"), "stream"),
]


@pytest.mark.parametrize("build,needle", [(b, n) for _, b, n in BAD], ids=[i for i, _, _ in BAD])
def test_bad_arguments_raise_and_write_nothing(build, needle) -> None:  # type: ignore[no-untyped-def]
    src = torch.arange(64, dtype=torch.uint8)
    host = torch.full((HOST,), 7, dtype=torch.uint8)
    args = build(src, host)
    kwargs = {"stream": args[3]} if len(args) > 3 else {}
    with pytest.raises(ValueError, match=needle):
        copy_to_host_runs(*args[:3], **kwargs)
    assert bool((host == 7).all())


@pytest.mark.parametrize("count", [1, MEMCPY_MAX_RUNS, MEMCPY_MAX_RUNS + 1, 64, 500])
@pytest.mark.parametrize("registered", [False, True])
@pytest.mark.parametrize("checked", [True, False])  # False: queue_to_host_runs
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_the_spec(count: int, registered: bool, checked: bool) -> None:
    from embcache.kernels import register_host_memory

    rng = random.Random(count)
    size = 8 << 20
    runs = [tuple(r) for r in random_runs(rng, size, count, 1 if count % 2 else 4096)]
    total = sum(n for _, n in runs)
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, device="cuda")
    if registered:
        host = torch.randint(0, 256, (size,), dtype=torch.uint8)
        registration = register_host_memory(host)
    else:
        host = torch.randint(0, 256, (size,), dtype=torch.uint8).pin_memory()
        registration = None
    try:
        want = spec(src, host, runs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        if checked:
            how = copy_to_host_runs(src, host, runs, stream=stream, host_registered=registered)
        else:
            how = queue_to_host_runs(src, host.data_ptr(), runs, stream)
        stream.synchronize()
        assert how == ("memcpy" if count <= MEMCPY_MAX_RUNS else "batch")
        assert torch.equal(host, want)
    finally:
        if registration is not None:
            registration.unregister()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_refuses_pageable_memory_and_a_foreign_stream() -> None:
    src = torch.zeros(64, dtype=torch.uint8, device="cuda")
    host = torch.full((HOST,), 7, dtype=torch.uint8)
    with pytest.raises(ValueError, match="pageable"):
        copy_to_host_runs(src, host, [(0, 64)])
    with pytest.raises(ValueError, match="stream"):
        copy_to_host_runs(src, host.pin_memory(), [(0, 64)], stream="s")  # type: ignore[arg-type]
    assert bool((host == 7).all())


@pytest.mark.parametrize("count", [3, 64])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_queue_on_a_raw_stream_handle_and_its_event(count: int) -> None:
    """queue_to_host_runs on a raw ``cudaStream_t`` (a side stream's, and the legacy default
    stream's, 0, which takes one memcpy per run), ordered after a long kernel there; an
    event from ``event_after`` is not fired before the copy is done, and is after."""
    from embcache.kernels import current_raw_stream
    from embcache.kernels._cudart import runtime

    rt = runtime()
    assert rt is not None
    rng = random.Random(count)
    size = 4 << 20
    runs = [tuple(r) for r in random_runs(rng, size, count, 4096)]
    total = sum(n for _, n in runs)
    host = torch.randint(0, 256, (size,), dtype=torch.uint8).pin_memory()
    for side in (torch.cuda.Stream(), None):
        with torch.cuda.stream(side):
            want = spec(torch.full((total,), count, dtype=torch.uint8), host.clone(), runs)
            src = torch.zeros(total, dtype=torch.uint8, device="cuda")
            torch.cuda.synchronize()
            handle = current_raw_stream(0)
            assert (handle == 0) == (side is None)
            torch.cuda._sleep(50_000_000)  # ~25 ms
            src.fill_(count)  # behind the sleep
            how = queue_to_host_runs(src, host.data_ptr(), runs, handle)
            event = rt.event_after(handle)
            assert not event.query()  # the sleep is still running
            event.synchronize()
            assert event.query()
        assert how == ("memcpy" if count <= MEMCPY_MAX_RUNS or side is None else "batch")
        assert torch.equal(host, want)


def test_register_host_range_refuses_bad_ranges() -> None:
    from embcache.kernels import register_host_range

    with pytest.raises(ValueError, match="ptr"):
        register_host_range(0, 4096)
    with pytest.raises(ValueError, match="nbytes"):
        register_host_range(4096, 0)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            register_host_range(torch.empty(4096, dtype=torch.uint8).data_ptr(), 4096)
