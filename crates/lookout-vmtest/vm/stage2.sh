#!/bin/busybox sh
# Stage 2 of a `cargo xtask vm-test` guest: the checks, run in order.
# Everything the host asserts on is printed to the console between
# "@@lk begin NAME" and "@@lk end NAME rc=N" lines; the host
# (crates/lookout-vmtest/src/check.rs) parses them. Every wait has a deadline.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
/bin/busybox --install -s /usr/bin 2>/dev/null

mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null
mount -t cgroup2 cgroup2 /sys/fs/cgroup
mount -t bpf bpf /sys/fs/bpf 2>/dev/null
mount -t tmpfs -o mode=0755 run /run
mount -t tmpfs -o mode=1777 tmp /tmp
ip link set lo up
# The memlock limit the agent lifts on kernels before 5.11.
ulimit -l 65536 2>/dev/null

# The agent runs from the image's own files, chrooted, the host's root at
# /host: what the DaemonSet's container sees.
A=/opt/lookout
mkdir -p /run/lookout /etc/lookout/hooks.d
mount --rbind / $A/host
mount --rbind /proc $A/proc
mount --rbind /sys $A/sys
mount --rbind /dev $A/dev
mount --bind /run/lookout $A/run/lookout
mount -t tmpfs tmp $A/tmp
export LOOKOUT_HOST_ROOT=/host LOOKOUT_LOG_FORMAT=json LOOKOUT_LOG=info
lookout() { chroot $A /usr/local/bin/lookout "$@"; }

section() {
    name=$1; shift
    echo "@@lk begin $name"
    "$@"
    rc=$?
    # (A newline first: the output may not end with one.)
    echo
    echo "@@lk end $name rc=$rc"
}

# Waits (0.1 s steps, at most $2 seconds) until grep -q "$3" "$1" matches.
wait_for() {
    i=0
    while ! grep -q "$3" "$1" 2>/dev/null; do
        i=$((i + 1))
        [ $i -ge $(($2 * 10)) ] && return 1
        sleep 0.1
    done
}

# The container of bundle $2 under runtime $1, with id $3: created, then
# started (as a CRI runtime's shim does), then waited for until it stops.
container() {
    "$1" create --bundle "/bundles/$2" "$3" </dev/null || { echo "create failed"; return 1; }
    # The runtime's own state, as this release writes it (kept for the host).
    cp "/run/$1/$3/state.json" "/tmp/state.$3" 2>/dev/null ||
        cp "/run/$1/$3/status" "/tmp/state.$3" 2>/dev/null
    "$1" start "$3" || { echo "start failed"; return 1; }
    i=0
    while "$1" state "$3" 2>/dev/null | grep -q '"status": *"\(created\|running\)"'; do
        i=$((i + 1))
        [ $i -ge 300 ] && { echo "still running after 30 s"; break; }
        sleep 0.1
    done
    "$1" delete --force "$3" 2>/dev/null
    echo "stopped"
}

# One agent run in mode $1: the agent, a consumer watching the API, the
# containers "$2..." (runtime:bundle:id), then SIGTERM.
agent_run() {
    mode=$1; shift
    rm -f /tmp/hook.out
    # chroot, not the function: $! is then the agent itself (chroot execs
    # it), not a subshell around it.
    chroot $A /usr/local/bin/lookout run --mode "$mode" --output json \
        --hooks-dir /host/etc/lookout/hooks.d >/tmp/events.$mode 2>/tmp/log.$mode &
    agent=$!
    if ! wait_for /tmp/log.$mode 60 '"ready"'; then
        echo "agent in mode $mode not ready within 60 s"
    fi
    lookout watch -o json >/tmp/watch.$mode 2>/tmp/watch-log.$mode &
    watch=$!
    # A gate consumer: each start is held 1 s, then allowed.
    gate=
    if [ "$mode" != scan ]; then
        lookout gate --name vm --hold 1s -o json >/tmp/gate.$mode 2>/tmp/gate-log.$mode &
        gate=$!
        wait_for /tmp/gate-log.$mode 20 subscribed || echo "the gate did not subscribe within 20 s"
    fi
    for c in "$@"; do
        rt=${c%%:*}; rest=${c#*:}; bundle=${rest%%:*}; id=${rest#*:}
        section "run.$mode.$id" container "$rt" "$bundle" "$id"
        section "state.$id" cat "/tmp/state.$id"
        wait_for /tmp/events.$mode 20 "\"removed\".*\"id\":\"$id\"" ||
            echo "no removed event for $id within 20 s"
    done
    section "metrics.$mode" wget -q -O - http://127.0.0.1:9477/metrics
    # Its memory after its containers (VmRSS, RssAnon, RssFile): the
    # image's own binary on this kernel and architecture.
    section "memory.$mode" grep -E '^(VmRSS|RssAnon|RssFile|RssShmem):' /proc/$agent/status
    kill -TERM $agent
    i=0
    while kill -0 $agent 2>/dev/null && [ $i -lt 300 ]; do i=$((i + 1)); sleep 0.1; done
    kill -KILL $agent $watch $gate 2>/dev/null
    wait $agent
    echo "agent exit=$?"
    section "events.$mode" cat /tmp/events.$mode
    section "watch.$mode" cat /tmp/watch.$mode
    section "log.$mode" cat /tmp/log.$mode
    section "hook.$mode" cat /tmp/hook.out
    [ -n "$gate" ] && section "gate.$mode" cat /tmp/gate.$mode /tmp/gate-log.$mode
}

echo "@@lk guest up"
section uname uname -r -m
# Without /dev/fd (udev and systemd make it on every real node), Debian's
# 5.10 kernel fails runc's and crun's re-exec from a memfd with ENOENT:
# TOMOYO, built in and stacked, resolves the exec's "/dev/fd/N" name.
# Recorded once here, then /dev/fd is made as a real node has it.
section devfd-missing container runc exit3 no-devfd
ln -s /proc/self/fd /dev/fd
ln -s /proc/self/fd/0 /dev/stdin
ln -s /proc/self/fd/1 /dev/stdout
ln -s /proc/self/fd/2 /dev/stderr
# (crun re-executes itself even for --version.)
section versions sh -c 'runc --version; crun --version'
section probe lookout probe -o json 2>/dev/null
agent_run auto runc:exit3:rc-auto crun:exit5:cr-auto
agent_run fanotify runc:exit3:rc-fan crun:exit5:cr-fan
agent_run scan runc:sleep-exit3:rc-scan crun:sleep-exit5:cr-scan
echo "@@lk done"
poweroff -f
