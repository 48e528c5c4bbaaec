"""Pods without a cluster: one network namespace per pod on a Linux bridge, name resolution
through /etc/netns/NAME/hosts, and each process started by pod_launcher.py in a mount
namespace that puts the manifest's volumes at their mountPaths (needs root)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.deploy.kube import PodPlan

LAUNCHER = Path(__file__).with_name("pod_launcher.py")
NETNS_ETC = Path("/etc/netns")


def sh(*command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, check=check, capture_output=True, text=True, timeout=30)


def can_create_namespaces() -> str:
    """'' when this process can create network namespaces and bridges, else why not."""
    if os.geteuid() != 0:
        return "needs root (ip netns add, bridges, mount namespaces)"
    for tool in ("ip", "ss"):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` command"
    probe = f"pwprobe{random.randrange(16**6):06x}"
    result = sh("ip", "netns", "add", probe, check=False)
    if result.returncode != 0:
        return f"cannot create a network namespace: {result.stderr.strip()}"
    sh("ip", "netns", "del", probe, check=False)
    return ""


def _free_subnet() -> str:
    """A 10.213.X.0/24 prefix ("10.213.X") that no interface or route of the host uses."""
    used = sh("ip", "-4", "addr").stdout + sh("ip", "-4", "route").stdout
    free = [x for x in range(1, 255) if f"10.213.{x}." not in used]
    return f"10.213.{random.choice(free)}"


@dataclass
class Pod:
    """A network namespace with one veth on the bridge, its address, and its process."""

    name: str  # the pod's name (its hostname)
    netns: str
    ip: str
    host_veth: str
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    started_at: float = 0.0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path else ""

    def listening(self) -> list[str]:
        """host:port of every TCP socket listening in the pod's namespace."""
        out = sh("ip", "netns", "exec", self.netns, "ss", "-ltnH").stdout
        return [line.split()[3] for line in out.splitlines() if line.strip()]

    def connections_to(self, ip: str, port: int) -> list[str]:
        """local host:port of each ESTABLISHED TCP connection from this pod to ip:port."""
        out = sh("ip", "netns", "exec", self.netns, "ss", "-tnH", "state", "established").stdout
        # With a state filter there is no state column: Recv-Q Send-Q Local Peer. gRPC's
        # sockets may be IPv6 ones: an IPv4 peer then reads [::ffff:IP]:PORT.
        peers = {f"{ip}:{port}", f"[::ffff:{ip}]:{port}"}
        return [fields[2] for fields in map(str.split, out.splitlines())
                if len(fields) >= 4 and fields[3] in peers]

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)


@dataclass
class Hosts:
    """A bridge, pods on it, and the host's own address on it (the test's client side)."""

    work_dir: Path
    suffix: str = field(default_factory=lambda: f"{random.randrange(16**6):06x}")
    pods: list[Pod] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.subnet = _free_subnet()
        self.bridge = f"pwbr{self.suffix}"
        self.client_ip = f"{self.subnet}.1"
        self._created_netns_etc = not NETNS_ETC.exists()
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.client_ip}/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")

    def add_pod(self, name: str) -> Pod:
        index = len(self.pods)
        pod = Pod(name, f"pw{self.suffix}-{name}", f"{self.subnet}.{index + 10}",
                  f"pwh{self.suffix}{index}")
        self.pods.append(pod)
        peer = f"pwp{self.suffix}{index}"
        sh("ip", "netns", "add", pod.netns)
        sh("ip", "link", "add", pod.host_veth, "type", "veth", "peer", "name", peer)
        sh("ip", "link", "set", pod.host_veth, "master", self.bridge)
        sh("ip", "link", "set", pod.host_veth, "up")
        sh("ip", "link", "set", peer, "netns", pod.netns)
        inside = ("ip", "netns", "exec", pod.netns)
        sh(*inside, "ip", "link", "set", peer, "name", "eth0")
        sh(*inside, "ip", "addr", "add", f"{pod.ip}/24", "dev", "eth0")
        sh(*inside, "ip", "link", "set", "eth0", "up")
        sh(*inside, "ip", "link", "set", "lo", "up")
        return pod

    def write_name_files(self, pod: Pod, names: dict[str, str], search: list[str]) -> None:
        """/etc/netns/<netns>/hosts (`names`: name -> IP, plus the pod's own name, as the
        kubelet writes it) and a resolv.conf with the cluster's search path and no server
        (a name missing from hosts fails at once instead of timing out)."""
        folder = NETNS_ETC / pod.netns
        folder.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
                 f"{pod.ip}\t{pod.name}"]
        lines += [f"{ip}\t{name}" for name, ip in names.items()]
        (folder / "hosts").write_text("\n".join(lines) + "\n")
        (folder / "resolv.conf").write_text(
            f"search {' '.join(search)}\nnameserver 127.0.0.1\noptions ndots:5 attempts:1\n")

    def start(self, pod: Pod, plan: PodPlan, mounts: list[dict[str, object]],
              env: dict[str, str]) -> None:
        """Starts the plan's argv in `pod` (volumes at their mountPaths), logs in work_dir."""
        root = self.work_dir / f"root-{pod.name}"
        root.mkdir()
        spec = {"root": str(root), "hostname": pod.name, "cwd": "/", "argv": plan.argv,
                "env": env, "read_only_root": plan.read_only_root, "mounts": mounts}
        spec_path = self.work_dir / f"{pod.name}.json"
        spec_path.write_text(json.dumps(spec, indent=1))
        pod.log_path = self.work_dir / f"{pod.name}.log"
        with open(pod.log_path, "wb") as log:
            pod.process = subprocess.Popen(
                ["ip", "netns", "exec", pod.netns, sys.executable, str(LAUNCHER),
                 str(spec_path)], stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        pod.started_at = time.monotonic()

    def cut(self, pod: Pod) -> None:
        """The pod's process dies, then its link goes down: the kernel closes the process's
        sockets as it dies, so its peers get a FIN (or RST) at once."""
        pod.kill()
        sh("ip", "link", "set", pod.host_veth, "down")

    def partition(self, pod: Pod) -> None:
        """The pod's host drops off the network (power loss or partition as its peers see
        it): its link goes down with its process still running, so no FIN, RST or anything
        else reaches them; their connections to it stay open until something notices."""
        sh("ip", "link", "set", pod.host_veth, "down")

    def close(self) -> None:
        """Kills every process, deletes the namespaces, veths, bridge and name files."""
        for pod in self.pods:
            if pod.process is not None and pod.process.poll() is None:
                pod.process.terminate()
        deadline = time.monotonic() + 10
        for pod in self.pods:
            if pod.process is not None:
                try:
                    pod.process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pod.kill()
        for pod in self.pods:
            sh("ip", "netns", "del", pod.netns, check=False)
            sh("ip", "link", "del", pod.host_veth, check=False)
            shutil.rmtree(NETNS_ETC / pod.netns, ignore_errors=True)
        sh("ip", "link", "del", self.bridge, check=False)
        if self._created_netns_etc:
            with contextlib.suppress(OSError):
                NETNS_ETC.rmdir()
