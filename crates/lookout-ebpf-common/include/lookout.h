/* SPDX-License-Identifier: (Apache-2.0 OR MIT OR GPL-2.0) */
/*
 * lookout.h: the container maps that the lookout agent pins, for BPF
 * programs in C (libbpf) and Go (cilium/ebpf, bpf2go).
 *
 * The agent writes each container's entry before the container's first
 * instruction runs (on every backend that holds its start) and removes it
 * when the container exits. Both maps are BPF_MAP_TYPE_HASH with
 * BPF_F_NO_PREALLOC | BPF_F_RDONLY_PROG (programs read, only the agent
 * writes), u64 keys and struct lookout_container values, pinned
 * under /sys/fs/bpf/lookout/ (the agent's --bpf-pin-dir), mode 0700.
 *
 * This header is checked against the Rust definition (lookout-ebpf-common's
 * ContainerEntry) by that crate's tests: every size and offset.
 */
#ifndef LOOKOUT_H
#define LOOKOUT_H

#ifndef __VMLINUX_H__
#include <linux/types.h>
#endif

#define LOOKOUT_CONTAINER_MAPS_DIR "/sys/fs/bpf/lookout"
#define LOOKOUT_CONTAINERS_BY_CGROUP "containers_by_cgroup"
#define LOOKOUT_CONTAINERS_BY_MNTNS "containers_by_mntns"
/* The agent's default --bpf-map-max-entries. libbpf reuses a pinned map
 * only when max_entries and map_flags match: a node whose agent runs with
 * another value needs bpf_map__set_max_entries() before loading. */
#define LOOKOUT_CONTAINER_MAPS_MAX_ENTRIES 16384
/* map_flags of both maps: BPF_F_NO_PREALLOC | BPF_F_RDONLY_PROG. */
#define LOOKOUT_CONTAINER_MAPS_FLAGS 0x81

/* Layout version of struct lookout_container. Later versions only use
 * bytes reserved here and keep the size: check version >= 1. */
#define LOOKOUT_CONTAINER_VERSION 1
#define LOOKOUT_CONTAINER_ID_LEN 64
/* flags: id is longer than LOOKOUT_CONTAINER_ID_LEN; its first 64 bytes. */
#define LOOKOUT_CONTAINER_ID_TRUNCATED 1

/* kind */
#define LOOKOUT_KIND_UNKNOWN 0
#define LOOKOUT_KIND_REGULAR 1
#define LOOKOUT_KIND_INIT 2
#define LOOKOUT_KIND_EPHEMERAL 3
#define LOOKOUT_KIND_SANDBOX 4

/* runtime */
#define LOOKOUT_RUNTIME_OTHER 0
#define LOOKOUT_RUNTIME_RUNC 1
#define LOOKOUT_RUNTIME_CRUN 2
#define LOOKOUT_RUNTIME_RUNSC 3
#define LOOKOUT_RUNTIME_YOUKI 4
#define LOOKOUT_RUNTIME_CONMON 5

/* The value of both maps: 128 bytes, no implicit padding. */
struct lookout_container {
	__u16 version;     /* LOOKOUT_CONTAINER_VERSION when written */
	__u8 kind;         /* LOOKOUT_KIND_* */
	__u8 runtime;      /* LOOKOUT_RUNTIME_* */
	__u8 id_len;       /* bytes of id in use, at most 64 */
	__u8 flags;        /* LOOKOUT_CONTAINER_ID_TRUNCATED */
	__u8 pad[2];
	__u64 pid_ns;      /* inode of the container's pid namespace, 0 if unknown */
	__u64 cgroup_id;   /* its key in containers_by_cgroup, 0 if unknown */
	__u64 mnt_ns;      /* its key in containers_by_mntns, 0 if unknown */
	char id[LOOKOUT_CONTAINER_ID_LEN]; /* the runtime's container id, NUL-padded */
	__u8 reserved[32]; /* zero */
};

#endif /* LOOKOUT_H */
