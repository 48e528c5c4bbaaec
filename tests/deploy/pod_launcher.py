"""Starts one "pod" process: `python pod_launcher.py SPEC.json`, run under `ip netns exec`.

In a mount and UTS namespace of its own it builds the container's file system view without
touching the host's: a tmpfs root holding bind mounts of the host's top-level entries, each
volume bound at its mountPath (directories on the way are tmpfs copies of the host's, so no
folder is created on the host), everything but the volumes remounted read-only when the
manifest says readOnlyRootFilesystem; then it sets the hostname to the pod's name, chroots,
and execs the container's argv with exactly the environment given.

SPEC.json: {"root": empty dir, "hostname": str, "cwd": str, "argv": [...], "env": {...},
"read_only_root": bool, "mounts": [{"source": dir or file, "target": path,
"read_only": bool}]}
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
MS_RDONLY, MS_NOSUID, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 32, 4096, 16384, 1 << 18
# The kernel's own file systems keep their own flags (Kubernetes mounts them read-write or
# as the runtime decides, whatever readOnlyRootFilesystem says).
KERNEL_DIRS = ("/proc", "/sys", "/dev")

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int,
          data: str | None = None) -> None:
    def encode(text: str | None) -> bytes | None:
        return text.encode() if text is not None else None

    _check(_libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags),
                       encode(data)), f"mount {source} on {target}")


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def build_root(root: str, mounts: list[dict[str, object]]) -> list[str]:
    """Fills `root` (a fresh tmpfs) with the host's tree and the volumes; returns the volume
    targets (inside `root`)."""
    # A mountPath under a host symlink (/var/run -> /run) lands where the link points.
    targets = {os.path.realpath(str(m["target"])): m for m in mounts}
    shadowed = {"/"}
    for target in targets:
        parent = os.path.dirname(target)
        while parent not in shadowed:
            shadowed.add(parent)
            parent = os.path.dirname(parent)

    def populate(directory: str) -> None:
        names = set(os.listdir(directory)) if os.path.isdir(directory) else set()
        names |= {os.path.basename(p) for p in (*shadowed, *targets)
                  if p != "/" and os.path.dirname(p) == directory}
        for name in sorted(names):
            host = os.path.join(directory, name)
            inside = root + host
            if host in targets or host in shadowed:
                if host in targets and os.path.isfile(str(targets[host]["source"])):
                    open(inside, "w").close()
                else:
                    os.mkdir(inside)
                if host in shadowed:
                    populate(host)
            elif os.path.islink(host):
                os.symlink(os.readlink(host), inside)
            elif os.path.isdir(host):
                os.mkdir(inside)
                mount(host, inside, None, MS_BIND | MS_REC)
            else:
                open(inside, "w").close()
                try:
                    mount(host, inside, None, MS_BIND)
                except OSError:
                    os.unlink(inside)  # e.g. a socket that cannot be bound: left out

    populate("/")
    for target, spec in targets.items():
        mount(str(spec["source"]), root + target, None, MS_BIND | MS_REC)
        if spec.get("read_only"):
            mount(None, root + target, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    return [root + t for t in targets]


def _mount_points() -> list[str]:
    points = []
    with open("/proc/self/mountinfo") as info:
        for line in info:
            point = line.split()[4]
            points.append(point.encode().decode("unicode_escape"))  # \040 etc.
    return points


def make_read_only(root: str, volumes: list[str]) -> None:
    """Remounts every mount under `root` read-only, but the volumes and the kernel's file
    systems (per mount point: the host's own mounts are unchanged)."""
    keep = [*volumes, *(root + d for d in KERNEL_DIRS)]
    for point in _mount_points():
        if not _under(point, root) or any(_under(point, k) for k in keep):
            continue
        try:
            mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)
        except OSError:
            mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY)


def main() -> None:
    with open(sys.argv[1]) as spec_file:
        spec = json.load(spec_file)
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWUTS), "unshare")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = spec["root"]
    mount("tmpfs", root, "tmpfs", 0, "mode=755")
    volumes = build_root(root, spec["mounts"])
    if spec.get("read_only_root"):
        make_read_only(root, volumes)
    socket.sethostname(spec["hostname"])
    os.chroot(root)
    os.chdir(spec.get("cwd") or "/")
    argv = spec["argv"]
    os.execve(argv[0], argv, spec["env"])


if __name__ == "__main__":
    main()
