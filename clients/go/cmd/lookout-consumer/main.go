// Command lookout-consumer lists and watches the containers that the lookout
// agent on this node knows, with grpc-go and its default options.
//
//	sudo lookout-consumer list
//	sudo lookout-consumer watch [-until ID]
//	sudo lookout-consumer -socket /run/lookout/lookout.sock list
//	sudo lookout-consumer list -workload Deployment/shop/api -cgroup-id 7301
//
// The filter flags (-runtime, -namespace, -workload, -cgroup-id,
// -image-digest) are repeatable: any of one flag's values matches, and every
// flag given must match.
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
	"strconv"
	"strings"
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

// known is nil for the wire's "not known" (0, ""), so that it prints as null.
func known(v interface{}) interface{} {
	switch x := v.(type) {
	case uint64:
		if x == 0 {
			return nil
		}
	case string:
		if x == "" {
			return nil
		}
	}
	return v
}

func container(c *lookoutv1.Container) map[string]interface{} {
	k := c.GetKubernetes()
	var workload interface{}
	if w := k.GetWorkload(); w.GetKind() != "" {
		workload = w.GetKind() + "/" + w.GetNamespace() + "/" + w.GetName()
	}
	return map[string]interface{}{
		"id": c.GetId(), "runtime": c.GetRuntime(), "pid": c.GetPid(), "status": c.GetStatus(),
		"namespace": k.GetNamespace(), "pod": k.GetPod(), "container": k.GetContainer(),
		"name": c.GetName(), "image": c.GetImage(), "labels": c.GetLabels(),
		"cgroup_id": known(c.GetCgroupId()), "kind": known(c.GetKind()), "workload": workload,
		"image_digest": known(c.GetImageDigest()), "mnt_ns": known(c.GetNamespaces().GetMnt()),
		"unresolved": c.GetUnresolved(),
	}
}

// repeated is a flag that may be given more than once.
type repeated []string

func (r *repeated) String() string     { return strings.Join(*r, ",") }
func (r *repeated) Set(v string) error { *r = append(*r, v); return nil }

// filterFlags adds the filter flags to fs; the function returned builds the
// Filter once fs is parsed.
func filterFlags(fs *flag.FlagSet) func() (*lookoutv1.Filter, error) {
	var runtimes, namespaces, workloads, cgroupIDs, digests repeated
	fs.Var(&runtimes, "runtime", "only this runtime (repeatable)")
	fs.Var(&namespaces, "namespace", "only this Kubernetes namespace (repeatable)")
	fs.Var(&workloads, "workload", "only this workload, Kind/namespace/name (repeatable)")
	fs.Var(&cgroupIDs, "cgroup-id", "only this cgroup id, as bpf_get_current_cgroup_id() (repeatable)")
	fs.Var(&digests, "image-digest", "only this image, repo@sha256:... or sha256:... (repeatable)")
	return func() (*lookoutv1.Filter, error) {
		f := &lookoutv1.Filter{
			Runtimes: runtimes, Namespaces: namespaces, Workloads: workloads, ImageDigests: digests,
		}
		for _, s := range cgroupIDs {
			id, err := strconv.ParseUint(s, 10, 64)
			if err != nil {
				return nil, fmt.Errorf("-cgroup-id %q: %v", s, err)
			}
			f.CgroupIds = append(f.CgroupIds, id)
		}
		return f, nil
	}
}

func list(client lookoutv1.LookoutClient, filter *lookoutv1.Filter) error {
	// A List has a deadline; a Watch has none.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := client.List(ctx, &lookoutv1.ListRequest{Filter: filter})
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
func watch(client lookoutv1.LookoutClient, filter *lookoutv1.Filter, until string) error {
	var since uint64
	known := map[string]*lookoutv1.Container{}
	for {
		stream, err := client.Watch(context.Background(), &lookoutv1.WatchRequest{Since: since, Filter: filter})
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
		fmt.Fprintln(os.Stderr, "usage: lookout-consumer [-socket PATH] list | watch [-until ID] [filter flags]")
		os.Exit(2)
	}
	if flag.NArg() < 1 {
		usage()
	}
	cmd := flag.NewFlagSet(flag.Arg(0), flag.ExitOnError)
	until := cmd.String("until", "", "watch: stop after this container's ADDED")
	filterOf := filterFlags(cmd)
	if (flag.Arg(0) != "list" && flag.Arg(0) != "watch") || cmd.Parse(flag.Args()[1:]) != nil || cmd.NArg() != 0 {
		usage()
	}
	filter, err := filterOf()
	if err != nil {
		fmt.Fprintln(os.Stderr, "lookout-consumer:", err)
		os.Exit(2)
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
		err = list(client, filter)
	} else {
		err = watch(client, filter, *until)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "lookout-consumer:", err)
		os.Exit(1)
	}
}
