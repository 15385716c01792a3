#!/usr/bin/env python3
"""A lookout consumer in Python, with grpcio and its default options.

    pip install grpcio grpcio-tools grpcio-health-checking grpcio-reflection
    sudo python3 lookout_consumer.py list
    sudo python3 lookout_consumer.py watch
    sudo python3 lookout_consumer.py watch --workload Deployment/shop/api
    sudo python3 lookout_consumer.py list --cgroup-id 7301 --image-digest sha256:9b2e...
    sudo python3 lookout_consumer.py gate --deny SOME_ID
    python3 lookout_consumer.py health
    python3 lookout_consumer.py services

The client code is generated from the proto at start-up (grpc_tools.protoc, into
a temporary directory), so nothing generated needs to be kept in step. Each line
printed is one JSON object.
"""

import argparse
import json
import os
import queue
import sys
import tempfile
import time

import grpc

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PROTO_DIR = os.path.join(HERE, "..", "..", "crates", "lookout-api", "proto")


def load_stubs(proto_dir):
    """Generates and imports lookout.v1's Python code."""
    from grpc_tools import protoc

    out = tempfile.mkdtemp(prefix="lookout-stubs-")
    # grpc_tools ships the well-known types' protos; give their directory too.
    import grpc_tools

    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    rc = protoc.main(
        [
            "protoc",
            f"-I{proto_dir}",
            f"-I{well_known}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            os.path.join(proto_dir, "lookout", "v1", "lookout.proto"),
        ]
    )
    if rc != 0:
        sys.exit(f"protoc failed ({rc}) on {proto_dir}/lookout/v1/lookout.proto")
    sys.path.insert(0, out)
    from lookout.v1 import lookout_pb2, lookout_pb2_grpc

    return lookout_pb2, lookout_pb2_grpc


def emit(**fields):
    print(json.dumps(fields), flush=True)


def container_json(c):
    k = c.kubernetes
    w = k.workload
    return {
        "id": c.id,
        "runtime": c.runtime,
        "pid": c.pid,
        "status": c.status,
        "namespace": k.namespace,
        "pod": k.pod,
        "container": k.container,
        "name": c.name,
        "image": c.image,
        "labels": dict(c.labels),
        # 0 and "" on the wire are "not known": None here.
        "cgroup_id": c.cgroup_id or None,
        "kind": c.kind or None,
        "workload": f"{w.kind}/{w.namespace}/{w.name}" if k.HasField("workload") and w.kind else None,
        "image_digest": c.image_digest or None,
        "mnt_ns": c.namespaces.mnt or None,
        "unresolved": dict(c.unresolved),
    }


def filter_of(pb, args):
    """The filter flags as the proto's Filter: any of each flag's values,
    every flag given."""
    return pb.Filter(
        runtimes=args.runtime,
        namespaces=args.namespace,
        workloads=args.workload,
        cgroup_ids=args.cgroup_id,
        image_digests=args.image_digest,
    )


def cmd_list(pb, stub, args):
    resp = stub.List(pb.ListRequest(filter=filter_of(pb, args)), timeout=args.timeout)
    emit(revision=resp.revision, count=len(resp.containers))
    for c in resp.containers:
        emit(container=container_json(c))


def cmd_watch(pb, stub, args):
    """Every change, resumed from the last revision after a dropped stream:
    nothing is lost and nothing is passed on twice."""
    kinds = pb.WatchEvent.Kind
    since = args.since
    known = {}
    while True:
        snapshot = None  # None: not inside a snapshot
        try:
            # A Watch has no deadline: it runs as long as the agent does.
            for ev in stub.Watch(pb.WatchRequest(since=since, filter=filter_of(pb, args))):
                kind = kinds.Name(ev.kind)
                if kind == "SNAPSHOT":
                    snapshot = snapshot if snapshot is not None else {}
                    snapshot[ev.container.id] = ev.container
                elif kind == "SNAPSHOT_END":
                    # The snapshot replaces what was known, even at a lower
                    # revision (an agent restarted without its history).
                    known, snapshot, since = snapshot or {}, None, ev.revision
                    emit(event=kind, revision=since, containers=len(known))
                elif kind in ("ADDED", "UPDATED", "REMOVED"):
                    if ev.revision <= since:
                        continue  # passed on already
                    since = ev.revision
                    line = {"event": kind, "revision": since, "container": container_json(ev.container)}
                    if kind != "REMOVED":
                        # UPDATED: the container as now known (Docker's
                        # name, image and labels); it replaces what was known.
                        known[ev.container.id] = ev.container
                    else:
                        known.pop(ev.container.id, None)
                        if ev.HasField("exit_code"):
                            line["exit_code"] = ev.exit_code
                    emit(**line)
                    if args.until and kind == "ADDED" and ev.container.id == args.until:
                        return
                # A kind added later: skipped, `since` unmoved.
        except grpc.RpcError as e:
            # UNAVAILABLE: the agent restarts; RESOURCE_EXHAUSTED: this
            # consumer fell behind and was dropped. Both: watch again.
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
                raise
            emit(event="RECONNECT", since=since, code=e.code().name)
            time.sleep(1)


def cmd_gate(pb, stub, args):
    """Holds on container starts, answered. When the agent ends the gate
    (a rollout hands the socket to the new agent, or the agent restarts),
    subscribe again under the same name: the new agent of a rollout holds
    the starts of this gate for it meanwhile."""
    subscribe = pb.GateRequest(
        subscribe=pb.Subscribe(
            name=args.name,
            filter=filter_of(pb, args),
            deadline_ms=args.deadline_ms,
            on_failure=pb.FAIL_OPEN,
        )
    )

    def outgoing(requests):
        while True:
            r = requests.get()
            if r is None:
                return
            yield r

    answered = 0
    while True:
        requests = queue.Queue()
        requests.put(subscribe)
        try:
            for resp in stub.Gate(outgoing(requests)):
                if resp.HasField("subscribed"):
                    emit(subscribed=resp.subscribed.name, deadline_ms=resp.subscribed.deadline_ms)
                    continue
                hold = resp.hold
                if args.holds and answered >= args.holds:
                    continue  # closing: the agent answers this one by our policy
                allow = hold.container.id not in args.deny
                if hold.held:
                    # A hold that is not held (a container that cannot be
                    # held) is news only: it takes no decision.
                    requests.put(
                        pb.GateRequest(
                            decision=pb.Decision(
                                hold_id=hold.hold_id,
                                allow=allow,
                                reason="" if allow else "denied by lookout_consumer.py",
                            )
                        )
                    )
                emit(hold=hold.container.id, held=hold.held, allow=allow, container=container_json(hold.container))
                answered += 1
                if args.holds and answered >= args.holds:
                    # Close our side after the decisions, which go first,
                    # in order; the agent then ends the stream. Cancelling
                    # the call instead could drop a decision not yet sent,
                    # and the hold would fall to the on_failure policy.
                    requests.put(None)
            if args.holds and answered >= args.holds:
                return
            # The agent ended the gate without an error: it stops.
            emit(resubscribe="ended")
        except grpc.RpcError as e:
            # UNAVAILABLE: the agent went away (a rollout, a restart).
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            emit(resubscribe=e.code().name)
        finally:
            requests.put(None)
        time.sleep(0.2)


def cmd_health(_pb, channel, args):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "lookout.v1.Lookout"):
        r = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=args.timeout)
        emit(service=service, status=health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))


def cmd_services(_pb, channel, _args):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    db = ProtoReflectionDescriptorDatabase(channel)
    services = sorted(db.get_services())
    emit(services=services)
    # Resolve a method through reflection alone, as grpcurl does.
    from google.protobuf.descriptor_pool import DescriptorPool

    pool = DescriptorPool(db)
    svc = pool.FindServiceByName("lookout.v1.Lookout")
    emit(methods=[m.name for m in svc.methods])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--socket", default="/run/lookout/lookout.sock")
    p.add_argument("--proto-dir", default=DEFAULT_PROTO_DIR)
    p.add_argument("--timeout", type=float, default=10.0, help="deadline of unary calls (s)")
    sub = p.add_subparsers(dest="cmd", required=True)

    def filtered(parser):
        """The filter flags, each repeatable."""
        parser.add_argument("--runtime", action="append", default=[])
        parser.add_argument("--namespace", action="append", default=[], help="Kubernetes namespace")
        parser.add_argument(
            "--workload", action="append", default=[], help="Kind/namespace/name, e.g. Deployment/shop/api"
        )
        parser.add_argument("--cgroup-id", action="append", type=int, default=[], help="what bpf_get_current_cgroup_id() returns")
        parser.add_argument(
            "--image-digest", action="append", default=[], help="repo@sha256:..., or sha256:... (also the image id)"
        )
        return parser

    filtered(sub.add_parser("list", help="the containers now"))
    w = filtered(sub.add_parser("watch", help="every change, resumed on reconnect"))
    w.add_argument("--since", type=int, default=0)
    w.add_argument("--until", help="stop after this container's ADDED")
    g = filtered(sub.add_parser("gate", help="hold each start; allow all but --deny"))
    g.add_argument("--name", default="python-example")
    g.add_argument("--deny", action="append", default=[])
    g.add_argument("--deadline-ms", type=int, default=5000)
    g.add_argument("--holds", type=int, default=0, help="stop after N holds (0: never)")
    sub.add_parser("health", help="grpc.health.v1 statuses")
    sub.add_parser("services", help="services and methods by server reflection")
    args = p.parse_args()

    # The socket path as the target and no authority option: the agent
    # accepts the :authority grpcio sends there. One option raises the
    # receive limit from 4 MiB: a List of many annotated containers is more.
    channel = grpc.insecure_channel(
        "unix://" + os.path.abspath(args.socket),
        options=[("grpc.max_receive_message_length", 256 << 20)],
    )
    if args.cmd in ("health", "services"):
        {"health": cmd_health, "services": cmd_services}[args.cmd](None, channel, args)
        return
    pb, pb_grpc = load_stubs(args.proto_dir)
    stub = pb_grpc.LookoutStub(channel)
    {"list": cmd_list, "watch": cmd_watch, "gate": cmd_gate}[args.cmd](pb, stub, args)


if __name__ == "__main__":
    main()
