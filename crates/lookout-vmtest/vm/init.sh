#!/bin/busybox sh
# Stage 1 of a `cargo xtask vm-test` guest (the initramfs's /init).
# runc cannot pivot_root out of an initramfs, so the tree is copied into a
# tmpfs first and the guest goes on there (stage2.sh).
B=/bin/busybox
$B mkdir -p /dev /proc /newroot
$B mount -t devtmpfs dev /dev
$B mount -t tmpfs -o mode=0755 root /newroot
for f in /*; do
    case "$f" in /newroot|/dev|/proc) ;; *) $B cp -a "$f" /newroot/ ;; esac
done
$B mkdir -p /newroot/dev /newroot/proc
$B umount /dev
exec $B switch_root /newroot /stage2
