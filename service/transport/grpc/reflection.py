"""Server reflection under both of its names: ``grpc.reflection.v1`` and ``v1alpha``.

grpcio-reflection serves only v1alpha, while current tools (grpcurl, Postman, grpcui) ask
v1 first. v1 is the same protocol under a new package name: its messages have the same
fields and numbers, so v1alpha's servicer answers a v1 call with exactly the bytes a v1
server would send. This module derives the v1 file descriptor from v1alpha's (renamed), adds
it to the descriptor pool so reflection can describe the v1 service too, and registers the
one servicer under both service names.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1ALPHA_SERVICE = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE = f"{V1_PACKAGE}.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def v1_file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """v1alpha's reflection.proto with its package (and the names that carry it) renamed."""
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old = f".{proto.package}."
    proto.name, proto.package = _V1_FILE, V1_PACKAGE
    proto.ClearField("options")  # v1alpha's java/objc package options
    for message in proto.message_type:
        for fld in message.field:
            if fld.type_name.startswith(old):
                fld.type_name = f".{V1_PACKAGE}.{fld.type_name[len(old) :]}"
    for service in proto.service:
        for method in service.method:
            method.input_type = f".{V1_PACKAGE}.{method.input_type[len(old) :]}"
            method.output_type = f".{V1_PACKAGE}.{method.output_type[len(old) :]}"
    return proto


def _describe_v1(pool: descriptor_pool.DescriptorPool) -> None:
    try:
        pool.FindServiceByName(V1_SERVICE)
    except KeyError:
        pool.Add(v1_file_descriptor())


def enable_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Serve reflection on ``server`` as v1 and v1alpha, listing ``service_names`` and both
    reflection services."""
    _describe_v1(descriptor_pool.Default())
    names = (*service_names, V1_SERVICE, V1ALPHA_SERVICE)
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE, {"ServerReflectionInfo": handler}),)
    )
