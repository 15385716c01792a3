// Command lookout-consumer lists and watches the containers that the lookout
// agent on this node knows, with grpc-go and its default options.
//
//	sudo lookout-consumer list
//	sudo lookout-consumer watch [-until ID]
//	sudo lookout-consumer -socket /run/lookout/lookout.sock list
//
// Each line printed is one JSON object.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	lookoutv1 "github.com/lookout-dev/lookout/clients/go/lookoutv1"
)

func emit(v map[string]interface{}) {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	fmt.Println(string(b))
}

func container(c *lookoutv1.Container) map[string]interface{} {
	k := c.GetKubernetes()
	return map[string]interface{}{
		"id": c.GetId(), "runtime": c.GetRuntime(), "pid": c.GetPid(), "status": c.GetStatus(),
		"namespace": k.GetNamespace(), "pod": k.GetPod(), "container": k.GetContainer(),
		"name": c.GetName(), "image": c.GetImage(), "labels": c.GetLabels(),
	}
}

func list(client lookoutv1.LookoutClient) error {
	// A List has a deadline; a Watch has none.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := client.List(ctx, &lookoutv1.ListRequest{})
	if err != nil {
		return err
	}
	emit(map[string]interface{}{"revision": resp.GetRevision(), "count": len(resp.GetContainers())})
	for _, c := range resp.GetContainers() {
		emit(map[string]interface{}{"container": container(c)})
	}
	return nil
}

// watch passes on every change once, resuming from the last revision after a
// dropped stream (an agent restart, or RESOURCE_EXHAUSTED for a consumer that
// fell behind).
func watch(client lookoutv1.LookoutClient, until string) error {
	var since uint64
	known := map[string]*lookoutv1.Container{}
	for {
		stream, err := client.Watch(context.Background(), &lookoutv1.WatchRequest{Since: since})
		if err != nil {
			return err
		}
		var snapshot map[string]*lookoutv1.Container // nil: not inside a snapshot
		for {
			ev, err := stream.Recv()
			if err == io.EOF {
				break
			}
			if err != nil {
				code := status.Code(err)
				if code != codes.Unavailable && code != codes.ResourceExhausted {
					return err
				}
				emit(map[string]interface{}{"event": "RECONNECT", "since": since, "code": code.String()})
				time.Sleep(time.Second)
				break
			}
			switch ev.GetKind() {
			case lookoutv1.WatchEvent_SNAPSHOT:
				if snapshot == nil {
					snapshot = map[string]*lookoutv1.Container{}
				}
				snapshot[ev.GetContainer().GetId()] = ev.GetContainer()
			case lookoutv1.WatchEvent_SNAPSHOT_END:
				if snapshot == nil {
					snapshot = map[string]*lookoutv1.Container{}
				}
				// The snapshot replaces what was known, even at a lower revision.
				known, snapshot, since = snapshot, nil, ev.GetRevision()
				emit(map[string]interface{}{"event": "SNAPSHOT_END", "revision": since, "containers": len(known)})
			case lookoutv1.WatchEvent_ADDED, lookoutv1.WatchEvent_REMOVED, lookoutv1.WatchEvent_UPDATED:
				if ev.GetRevision() <= since {
					continue // passed on already
				}
				since = ev.GetRevision()
				c := ev.GetContainer()
				line := map[string]interface{}{"event": ev.GetKind().String(), "revision": since, "container": container(c)}
				if ev.GetKind() != lookoutv1.WatchEvent_REMOVED {
					// UPDATED: the container as now known (Docker's name,
					// image and labels); it replaces what was known.
					known[c.GetId()] = c
				} else {
					delete(known, c.GetId())
					if ev.ExitCode != nil {
						line["exit_code"] = ev.GetExitCode()
					}
				}
				emit(line)
				if until != "" && ev.GetKind() == lookoutv1.WatchEvent_ADDED && c.GetId() == until {
					return nil
				}
			default:
				// A kind added later: skipped, without moving `since`.
			}
		}
	}
}

func main() {
	socket := flag.String("socket", "/run/lookout/lookout.sock", "the agent's consumer socket")
	flag.Parse()
	usage := func() {
		fmt.Fprintln(os.Stderr, "usage: lookout-consumer [-socket PATH] list | watch [-until ID]")
		os.Exit(2)
	}
	if flag.NArg() < 1 {
		usage()
	}
	cmd := flag.NewFlagSet(flag.Arg(0), flag.ExitOnError)
	until := cmd.String("until", "", "watch: stop after this container's ADDED")
	if (flag.Arg(0) != "list" && flag.Arg(0) != "watch") || cmd.Parse(flag.Args()[1:]) != nil || cmd.NArg() != 0 {
		usage()
	}
	// A List of many annotated containers can pass gRPC's 4 MiB default.
	conn, err := grpc.Dial("unix://"+*socket,
		grpc.WithInsecure(),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(256<<20)))
	if err != nil {
		fmt.Fprintln(os.Stderr, "lookout-consumer:", err)
		os.Exit(1)
	}
	defer conn.Close()
	client := lookoutv1.NewLookoutClient(conn)
	if flag.Arg(0) == "list" {
		err = list(client)
	} else {
		err = watch(client, *until)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "lookout-consumer:", err)
		os.Exit(1)
	}
}
