"""A record fills a protobuf message by field name: scalars and repeated scalars, renamed
fields, ``None`` left unset (so a ``oneof`` member is set only when given)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import pytest

from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.locations import DevicePoolDesc, HostShmPool
from embcache.proto.records import counter, description, doc, fill_message


def test_same_named_fields_are_copied_and_others_skipped() -> None:
    desc = HostShmPool("host-1", "embcache-x", 1 << 20, 4096, "boot", 5, 6)
    msg = fill_message(pb.HostShmPool(), desc)  # pool_id: not a field of the message
    assert (msg.segment_name, msg.size, msg.page_bytes, msg.boot_id, msg.st_dev, msg.st_ino) == (
        "embcache-x", 1 << 20, 4096, "boot", 5, 6)  # fmt: skip


def test_none_is_left_unset_and_skip_and_renames_apply() -> None:
    desc = DevicePoolDesc("p", "GPU-1", 8192, 4096, "none")
    msg = fill_message(pb.DevicePool(), desc)
    assert msg.WhichOneof("handle") is None and msg.gpu_uuid == "GPU-1"
    legacy = DevicePoolDesc("p", "GPU-1", 8192, 4096, "legacy", ipc_handle=b"h")
    assert fill_message(pb.DevicePool(), legacy, skip=("ipc_handle",)).ipc_handle == b""
    renamed = fill_message(pb.PosixFdHandle(), legacy, renames={"size": "alloc_size"})
    assert renamed.alloc_size == 8192


def test_repeated_scalars_extend_and_messages_are_refused() -> None:
    @dataclass
    class Pages:
        page_ids: tuple[int, ...]

    assert list(fill_message(pb.PageList(), Pages((3, 1, 2))).page_ids) == [3, 1, 2]

    @dataclass
    class WithMessage:
        meta: int

    with pytest.raises(TypeError, match="meta"):
        fill_message(pb.GetResult(), WithMessage(1))


def test_descriptions_live_in_the_field_metadata() -> None:
    @dataclass
    class Counts:
        hits: int = counter("Lookups that found the key.")
        name: str = "x"

    hits, name = fields(Counts)
    assert description(hits) == "Lookups that found the key." and description(name) is None
    assert Counts().hits == 0 and doc("t") == {"description": "t"}
