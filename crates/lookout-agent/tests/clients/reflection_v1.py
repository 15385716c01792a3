"""Lists the services through grpc.reflection.v1 (what grpcurl and evans ask
first) with grpcio. grpcio-reflection's client speaks v1alpha only; v1's
messages are the same on the wire, so v1alpha's classes encode them and the
call goes to v1's method. Prints one service name per line."""

import sys

import grpc
from grpc_reflection.v1alpha import reflection_pb2

channel = grpc.insecure_channel("unix://" + sys.argv[1])
call = channel.stream_stream(
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
    response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
)
for resp in call(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10):
    for s in resp.list_services_response.service:
        print(s.name)
