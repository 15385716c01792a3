"""One gRPC call whose :authority is the socket's raw path, as grpc-java
(netty) and grpc-swift send it over a Unix socket. Uses the h2 package
(hyper-h2), which lets a client send any header. Prints the call's
grpc-status and the health status it got."""

import socket
import sys

import h2.config
import h2.connection
import h2.events

path = sys.argv[1]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
s.connect(path)
conn = h2.connection.H2Connection(
    h2.config.H2Configuration(client_side=True, validate_outbound_headers=False)
)
conn.initiate_connection()
conn.send_headers(
    1,
    [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/grpc.health.v1.Health/Check"),
        (":authority", path),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ],
)
# An empty HealthCheckRequest: uncompressed, length 0.
conn.send_data(1, b"\x00\x00\x00\x00\x00", end_stream=True)
s.sendall(conn.data_to_send())
headers, data, ended, reset = {}, b"", False, None
while not ended:
    chunk = s.recv(65536)
    if not chunk:
        break
    for ev in conn.receive_data(chunk):
        if isinstance(ev, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
            for k, v in ev.headers:
                headers[k.decode() if isinstance(k, bytes) else k] = (
                    v.decode() if isinstance(v, bytes) else v
                )
        elif isinstance(ev, h2.events.DataReceived):
            data += ev.data
            conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
        elif isinstance(ev, h2.events.StreamReset):
            reset = ev.error_code
            ended = True
        elif isinstance(ev, h2.events.StreamEnded):
            ended = True
    s.sendall(conn.data_to_send())
# HealthCheckResponse{status = 1 (SERVING)} is 08 01 after the 5-byte prefix.
status = data[6] if len(data) >= 7 and data[5] == 0x08 else 0
print(f"reset={reset} grpc-status={headers.get('grpc-status')} health={status}")
