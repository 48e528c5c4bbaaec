"""What the rendered manifests say a pod runs, read the way the kubelet reads it.

`render` runs `kubectl kustomize`; `pod_plan` turns one workload's main container into the
argv, environment, volume mounts, ports and probes of its process, with the kubelet's rules
for `$(VAR)` references (`expand`) and for the environment (plain values, `fieldRef`, earlier
variables, Service links unless `enableServiceLinks: false`).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

Manifest = dict[str, Any]


def render(overlay: Path) -> list[Manifest]:
    """The objects `kubectl kustomize overlay` renders."""
    text = subprocess.run(["kubectl", "kustomize", str(overlay)], check=True,
                          capture_output=True, text=True, timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(text) if doc]


def find(objects: Iterable[Manifest], kind: str, name: str) -> Manifest:
    for obj in objects:
        if obj.get("kind") == kind and obj["metadata"]["name"] == name:
            return obj
    raise LookupError(f"the manifests have no {kind} {name}")


def expand(text: str, lookup: Callable[[str], str | None]) -> str:
    """Kubernetes' `$(VAR)` expansion (k8s.io/kubernetes/third_party/forked/golang/expansion):
    `$(NAME)` becomes the variable's value when it is defined and stays as written when not;
    `$$` is one `$`; any other `$` stays as it is."""
    out: list[str] = []
    checkpoint = cursor = 0
    while cursor < len(text):
        if text[cursor] == "$" and cursor + 1 < len(text):
            out.append(text[checkpoint:cursor])
            rest = text[cursor + 1:]
            if rest[0] == "$":
                read, advance = "$", 1
            elif rest[0] == "(":
                close = rest.find(")", 1)
                if close < 0:
                    read, advance = "$(", 1
                else:
                    name = rest[1:close]
                    value = lookup(name)
                    read, advance = (f"$({name})" if value is None else value), close + 1
            else:
                read, advance = "$" + rest[0], 1
            out.append(read)
            cursor += advance
            checkpoint = cursor + 1
        cursor += 1
    return "".join(out) + text[checkpoint:]


def service_link_env(services: Iterable[Manifest], pod_namespace: str,
                     cluster_ip: Callable[[str], str]) -> dict[str, str]:
    """The variables the kubelet sets for every Service of the pod's namespace that has a
    cluster IP (`{NAME}_SERVICE_HOST`, `{NAME}_PORT=tcp://...`, ...)."""
    env: dict[str, str] = {}
    for service in services:
        spec = service.get("spec", {})
        if service["metadata"].get("namespace", "default") != pod_namespace:
            continue
        if spec.get("clusterIP") == "None" or spec.get("type") == "ExternalName":
            continue
        name = service["metadata"]["name"].upper().replace("-", "_")
        ip = cluster_ip(service["metadata"]["name"])
        ports = spec.get("ports", [])
        if not ports:
            continue
        env[f"{name}_SERVICE_HOST"] = ip
        env[f"{name}_SERVICE_PORT"] = str(ports[0]["port"])
        for port in ports:
            if port.get("name"):
                env[f"{name}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}"] = str(
                    port["port"])
            proto = port.get("protocol", "TCP")
            prefix = f"{name}_PORT_{port['port']}_{proto.upper()}"
            env[prefix] = f"{proto.lower()}://{ip}:{port['port']}"
            env[f"{prefix}_PROTO"] = proto.lower()
            env[f"{prefix}_PORT"] = str(port["port"])
            env[f"{prefix}_ADDR"] = ip
        env[f"{name}_PORT"] = f"{ports[0].get('protocol', 'TCP').lower()}://{ip}:{ports[0]['port']}"
    return env


@dataclass
class Volume:
    """One volume mount of the main container: what the manifest mounts at `path`."""

    name: str
    path: str
    read_only: bool
    source: Manifest  # the pod's volume entry (emptyDir, secret, persistentVolumeClaim, ...)
    sub_path: str = ""

    @property
    def kind(self) -> str:
        return next(k for k in self.source if k != "name")


@dataclass
class Probe:
    kind: str  # grpc, httpGet, tcpSocket, exec
    port: int
    service: str = ""  # grpc: the health service asked about
    path: str = ""  # httpGet


@dataclass
class PodPlan:
    """One pod's main container, as its process: argv, environment and what it mounts."""

    workload: str
    pod_name: str
    namespace: str
    argv: list[str]
    env: dict[str, str]
    volumes: list[Volume]
    ports: dict[str, int]  # container port name (or its number) -> number
    probes: dict[str, Probe]  # startupProbe / livenessProbe / readinessProbe
    run_as_user: int | None = None
    read_only_root: bool = False
    init_containers: list[str] = field(default_factory=list)

    def port(self, name: str) -> int:
        return self.ports[name]


def _port_number(port: int | str, ports: Mapping[str, int]) -> int:
    return port if isinstance(port, int) else ports[port]


def _probe(spec: Manifest, ports: Mapping[str, int]) -> Probe:
    for kind in ("grpc", "httpGet", "tcpSocket"):
        if kind in spec:
            body = spec[kind]
            return Probe(kind, _port_number(body["port"], ports), body.get("service", ""),
                         body.get("path", ""))
    return Probe("exec", 0)


def pod_plan(objects: list[Manifest], kind: str, name: str, pod_name: str, pod_ip: str,
             cluster_ip: Callable[[str], str]) -> PodPlan:
    """The main (first) container of workload `kind`/`name`, as pod `pod_name` at `pod_ip`."""
    workload = find(objects, kind, name)
    namespace = workload["metadata"].get("namespace", "default")
    pod = workload["spec"]["template"]["spec"]
    container = pod["containers"][0]
    field_values = {"status.podIP": pod_ip, "status.podIPs": pod_ip,
                    "metadata.name": pod_name, "metadata.namespace": namespace,
                    "spec.nodeName": f"node-{pod_name}", "status.hostIP": pod_ip,
                    "spec.serviceAccountName": pod.get("serviceAccountName", "default")}
    services = [o for o in objects if o.get("kind") == "Service"]
    service_env = (service_link_env(services, namespace, cluster_ip)
                   if pod.get("enableServiceLinks", True) else {})
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(str(var["value"]),
                                      lambda n: env.get(n, service_env.get(n)))
        elif "fieldRef" in var.get("valueFrom", {}):
            env[var["name"]] = field_values[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            raise NotImplementedError(f"{name}: env {var['name']}: {var['valueFrom']}")
    assert not container.get("envFrom"), f"{name}: envFrom is not emulated"
    # The kubelet puts the Service links first, the container's own variables over them.
    env = {**service_env, **env}
    # The image's ENTRYPOINT is `python -m`; a `command` would replace it.
    command = [expand(c, env.get) for c in container.get("command", [])]
    args = [expand(a, env.get) for a in container.get("args", [])]
    if command:
        python = command[0] in ("python", "python3")
        argv = [sys.executable if python else command[0], *command[1:], *args]
    else:
        argv = [sys.executable, "-m", *args]
    ports = {}
    for port in container.get("ports", []):
        ports[port.get("name") or str(port["containerPort"])] = port["containerPort"]
    pod_volumes = {v["name"]: v for v in pod.get("volumes", [])}
    volumes = [Volume(m["name"], m["mountPath"], bool(m.get("readOnly")),
                      pod_volumes[m["name"]], m.get("subPath", ""))
               for m in container.get("volumeMounts", [])]
    probes = {key: _probe(container[key], ports)
              for key in ("startupProbe", "livenessProbe", "readinessProbe") if key in container}
    security = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
    return PodPlan(name, pod_name, namespace, argv, env, volumes, ports, probes,
                   security.get("runAsUser"), bool(security.get("readOnlyRootFilesystem")),
                   [c["name"] for c in pod.get("initContainers", [])])
