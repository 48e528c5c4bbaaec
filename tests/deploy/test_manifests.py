"""The Kubernetes manifests in deploy/, checked offline: every overlay renders with
`kubectl kustomize`, every document is valid against the Kubernetes 1.31 schemas (strict: an
unknown field is an error), checkov finds nothing but the findings of SKIPPED below, and the
rendered pods keep the contract that docs/deploy.md and tests/deploy/test_multihost.py rely on
(names, ports, args, probes, security context, resources, grace periods).

Needs `kubectl` on PATH (it carries kustomize) and checkov in its own venv `.venv-checkov`
(checkov pins packaging<24, which pytest's venv cannot take): `make setup` creates it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CHECKOV = ROOT / ".venv-checkov" / "bin" / "checkov"
KUBERNETES_VERSION = "1.31"

# Everything `kubectl apply -k` is meant to take: the overlays, and the TLS example (the
# overlay cpu-demo with the component components/tls).
KUSTOMIZATIONS = {
    "cpu-demo": DEPLOY / "overlays" / "cpu-demo",
    "gpu": DEPLOY / "overlays" / "gpu",
    "cpu-demo-tls": DEPLOY / "examples" / "cpu-demo-tls",
}

# checkov findings allowed, each with why. Each is also skipped in the manifests themselves
# (a `checkov.io/skipN` annotation with the reason) so that a checkov run of its own agrees.
SKIPPED = {
    "CKV_K8S_43": "image by digest: the image is built and loaded per cluster (make image, "
                  "kind load); a registry deployment pins pagewire@sha256:... in its overlay",
    "CKV_K8S_15": "imagePullPolicy Always: it would make the kubelet pull the locally loaded "
                  "image from a registry that does not have it; IfNotPresent, and a digest in "
                  "a registry overlay, give the same guarantee",
}

# Each service's gRPC port, the only one its probes may use.
GRPC_PORTS = {"block-service": 50052, "runner": 50053, "gateway": 50051}
DEFAULT_GRACE_S = 5.0  # common/server.py
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob"}


def _render(path: Path) -> str:
    if shutil.which("kubectl") is None:
        pytest.fail("kubectl is not installed: install kubectl (it bundles kustomize), e.g. "
                    "apt-get install kubectl or https://kubernetes.io/docs/tasks/tools/; the "
                    "deploy/ manifests are rendered with `kubectl kustomize`")
    done = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, f"kubectl kustomize {path} failed:\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def rendered() -> dict[str, str]:
    with ThreadPoolExecutor(len(KUSTOMIZATIONS)) as pool:
        texts = pool.map(_render, KUSTOMIZATIONS.values())
        return dict(zip(KUSTOMIZATIONS, texts, strict=True))


@pytest.fixture(scope="module")
def documents(rendered: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
    return {name: [doc for doc in yaml.safe_load_all(text) if doc]
            for name, text in rendered.items()}


def _find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in WORKLOAD_KINDS]


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


# ----- schema -----------------------------------------------------------------------------


def test_every_document_is_valid_kubernetes(documents: dict[str, list[dict[str, Any]]]) -> None:
    import kubernetes_validate

    errors = []
    for overlay, docs in documents.items():
        assert docs, f"{overlay} renders nothing"
        for doc in docs:
            try:
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as error:
                errors.append(f"{overlay} {doc['kind']}/{doc['metadata']['name']}: "
                              f"{error.message} at {list(error.path)}")
            except kubernetes_validate.utils.SchemaNotFoundError as error:
                errors.append(f"{overlay}: {error.message}")
    assert not errors, "\n".join(errors)


def test_the_schema_check_is_strict(documents: dict[str, list[dict[str, Any]]]) -> None:
    import kubernetes_validate

    deployment = json.loads(json.dumps(
        _find(documents["cpu-demo"], "Deployment", "pagewire-gateway")))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


# ----- checkov ----------------------------------------------------------------------------


def _checkov(rendered_text: str, folder: Path) -> dict[str, Any]:
    folder.mkdir()
    (folder / "rendered.yaml").write_text(rendered_text)
    done = subprocess.run(
        [str(CHECKOV), "-d", str(folder), "--framework", "kubernetes", "-o", "json",
         "--skip-download"],
        capture_output=True, text=True, timeout=120, check=False,
        # No guideline download: the run is offline.
        env={"PATH": "/usr/bin:/bin", "BC_SKIP_MAPPING": "TRUE", "HOME": str(folder)},
    )
    assert done.returncode in (0, 1), f"checkov failed ({done.returncode}):\n{done.stderr}"
    report = json.loads(done.stdout)
    reports = report if isinstance(report, list) else [report]
    assert len(reports) == 1, [r.get("check_type") for r in reports]
    return dict(reports[0])


def test_checkov_finds_nothing_but_the_skipped(rendered: dict[str, str],
                                              tmp_path: Path) -> None:
    if not CHECKOV.exists():
        pytest.fail(f"{CHECKOV} is missing: `make setup` creates it (python3 -m venv "
                    ".venv-checkov && .venv-checkov/bin/pip install checkov==3.3.30)")
    with ThreadPoolExecutor(len(rendered)) as pool:
        reports = dict(zip(rendered, pool.map(
            _checkov, rendered.values(), [tmp_path / name for name in rendered]), strict=True))
    problems = []
    for overlay, report in reports.items():
        summary = report["summary"]
        # Not vacuous: every document parsed and the usual checks ran.
        assert summary["parsing_errors"] == 0, (overlay, summary)
        assert summary["resource_count"] >= 15, (overlay, summary)
        assert summary["passed"] >= 200, (overlay, summary)
        results = report["results"]
        for check in results["failed_checks"]:
            problems.append(f"{overlay}: {check['check_id']} {check['check_name']} "
                            f"on {check['resource']}")
        for check in results.get("skipped_checks", []):
            if check["check_id"] not in SKIPPED:
                problems.append(f"{overlay}: {check['check_id']} skipped in a manifest but "
                                f"not listed in SKIPPED with its reason")
    assert not problems, "\n".join(problems)


# ----- the contract -----------------------------------------------------------------------


@pytest.mark.parametrize("overlay", list(KUSTOMIZATIONS))
def test_no_loopback_or_wildcard_address(rendered: dict[str, str], overlay: str) -> None:
    for address in ("127.0.0.1", "localhost", "0.0.0.0"):
        assert address not in rendered[overlay], f"{overlay} names {address}"


@pytest.mark.parametrize("overlay", list(KUSTOMIZATIONS))
def test_names_ports_and_args(documents: dict[str, list[dict[str, Any]]],
                              overlay: str) -> None:
    docs = documents[overlay]
    block = _find(docs, "Deployment", "pagewire-block-service")
    assert block["spec"]["replicas"] == 1
    assert block["spec"]["strategy"] == {"type": "Recreate"}
    runner = _find(docs, "StatefulSet", "pagewire-runner")
    assert runner["spec"]["replicas"] == 2
    assert runner["spec"]["serviceName"] == "pagewire-runner"
    assert runner["spec"]["podManagementPolicy"] == "Parallel"
    gateway = _find(docs, "Deployment", "pagewire-gateway")
    assert gateway["spec"]["replicas"] == 2

    def args(workload: dict[str, Any]) -> list[str]:
        return list(workload["spec"]["template"]["spec"]["containers"][0]["args"])

    def starts_with(workload: dict[str, Any], expected: list[str]) -> None:
        assert args(workload)[:len(expected)] == expected

    token = "/etc/pagewire/internal/token"
    starts_with(block, [
        "block_service", "--host", "$(POD_IP)", "--port", "50052", "--metrics-port", "9090",
        "--journal-dir", "/var/lib/pagewire/journal", "--auth-token-file", token])
    starts_with(runner, [
        "gpu_runner", "--host", "$(POD_IP)", "--port", "50053", "--metrics-port", "9090",
        "--model", "/models/default", "--block-service", "pagewire-block-service:50052",
        "--advertise-address", "$(POD_IP):50053", "--auth-token-file", token,
        "--block-service-auth-token-file", token])
    starts_with(gateway, [
        "gateway", "--host", "$(POD_IP)", "--port", "50051", "--http-port", "8000",
        "--metrics-port", "9090", "--block-service", "pagewire-block-service:50052",
        "--model", "/models/default", "--backend-auth-token-file", token])

    block_service = _find(docs, "Service", "pagewire-block-service")
    assert block_service["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert {"name": "grpc", "port": 50052} in [
        {"name": p["name"], "port": p["port"]} for p in block_service["spec"]["ports"]]
    assert _find(docs, "Service", "pagewire-runner")["spec"]["clusterIP"] == "None"
    gateway_ports = {p["port"]: p["name"]
                     for p in _find(docs, "Service", "pagewire-gateway")["spec"]["ports"]}
    assert gateway_ports == {50051: "grpc", 8000: "http"}

    journal = _find(docs, "PersistentVolumeClaim", "pagewire-block-journal")
    assert journal["spec"]["accessModes"] == ["ReadWriteOnce"]
    volumes = {v["name"]: v for v in block["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"]
              for m in block["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    claim = volumes[mounts["/var/lib/pagewire/journal"]]["persistentVolumeClaim"]
    assert claim["claimName"] == "pagewire-block-journal"

    assert _find(docs, "PodDisruptionBudget", "pagewire-gateway")["spec"]["minAvailable"] == 1
    assert _find(docs, "PodDisruptionBudget", "pagewire-runner")["spec"]["maxUnavailable"] == 1
    assert not any(d["kind"] == "PodDisruptionBudget" and "block" in d["metadata"]["name"]
                   for d in docs)
    hpa = _find(docs, "HorizontalPodAutoscaler", "pagewire-gateway")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1", "kind": "Deployment", "name": "pagewire-gateway"}
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "pagewire_gateway_waiting_sequences"


def test_the_hpa_metric_is_the_gateways_gauge() -> None:
    from prometheus_client import REGISTRY

    import gateway.metrics  # noqa: F401  (registers the gateway's metrics)

    names = {metric.name for metric in REGISTRY.collect()}
    assert "pagewire_gateway_waiting_sequences" in names


def _containers(workload: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    spec = workload["spec"]["template"]["spec"]
    return ([("init", c) for c in spec.get("initContainers", [])]
            + [("main", c) for c in spec["containers"]])


@pytest.mark.parametrize("overlay", list(KUSTOMIZATIONS))
def test_every_pod_keeps_the_contract(documents: dict[str, list[dict[str, Any]]],
                                      overlay: str) -> None:
    docs = documents[overlay]
    secrets = {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"}
    workloads = _workloads(docs)
    assert {w["metadata"]["name"] for w in workloads} == {
        "pagewire-block-service", "pagewire-runner", "pagewire-gateway"}
    for workload in workloads:
        name = workload["metadata"]["name"]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        component = labels["app.kubernetes.io/component"]
        assert labels["app.kubernetes.io/name"] == name
        assert labels["app.kubernetes.io/part-of"] == "pagewire"
        assert workload["metadata"]["labels"] == labels
        spec = workload["spec"]["template"]["spec"]
        assert spec["securityContext"] == {
            "runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001,
            "seccompProfile": {"type": "RuntimeDefault"},
            **({"fsGroupChangePolicy": "OnRootMismatch"}
               if "fsGroupChangePolicy" in spec["securityContext"] else {}),
        }, name
        assert spec["automountServiceAccountToken"] is False, name
        # Service links would put PAGEWIRE_BLOCK_SERVICE_PORT=tcp://... and
        # PAGEWIRE_GATEWAY_PORT=tcp://... in the environment, which the services read as their
        # --port default (common/server.py) and fail to parse.
        assert spec["enableServiceLinks"] is False, name
        volumes = {v["name"]: v for v in spec["volumes"]}
        token_volume = volumes["internal-token"]["secret"]["secretName"]
        assert token_volume == "pagewire-internal-token"
        if overlay != "gpu":  # there the operator creates it (docs/deploy.md)
            assert token_volume in secrets

        for role, container in _containers(workload):
            where = f"{overlay} {name}/{container['name']}"
            assert container["securityContext"] == {
                "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]}}, where
            resources = container["resources"]
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources[bound]), where
            assert container["image"] == ("pagewire:cuda" if overlay == "gpu"
                                          else "pagewire:cpu"), where
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            for path in ("/cache", "/tmp"):
                assert "emptyDir" in volumes[mounts[path]["name"]], (where, path)
            env = {e["name"]: e for e in container.get("env", [])}
            assert env["PAGEWIRE_CACHE_DIR"]["value"] == "/cache", where
            if role == "init":
                continue
            args = container["args"]
            port = GRPC_PORTS[component]
            assert args[0] == {"block-service": "block_service", "runner": "gpu_runner",
                               "gateway": "gateway"}[component]
            assert _flag(args, "--host") == "$(POD_IP)", where
            assert _flag(args, "--port") == str(port), where
            assert _flag(args, "--metrics-port") == "9090", where
            assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
            assert mounts["/etc/pagewire/internal"]["name"] == "internal-token", where
            assert mounts["/etc/pagewire/internal"].get("readOnly") is True, where
            if "/models" in mounts:
                assert mounts["/models"].get("readOnly") is True, where
            if component == "runner" and overlay == "gpu":
                assert resources["limits"]["nvidia.com/gpu"] == 1, where

            # Probes: on the service's own gRPC port. The gateway's liveness is a TCP connect
            # (its gRPC health follows the backends, which must not restart it), and with TLS
            # (kubelet gRPC probes are plaintext) its readiness is HTTPS /health and its startup
            # a TCP connect.
            tls = _flag(args, "--tls-cert") is not None
            for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = container[probe_name]
                if component == "gateway" and (probe_name == "livenessProbe" or (
                        tls and probe_name == "startupProbe")):
                    assert probe["tcpSocket"] == {"port": port}, (where, probe_name)
                elif component == "gateway" and tls and probe_name == "readinessProbe":
                    assert probe["httpGet"] == {"path": "/health", "port": 8000,
                                                "scheme": "HTTPS"}, where
                else:
                    assert probe["grpc"] == {"port": port}, (where, probe_name)
            if component == "runner":  # model load: at least 10 minutes
                startup = container["startupProbe"]
                assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, where

            grace_s = float(_flag(args, "--grace-s") or DEFAULT_GRACE_S)
            assert _flag(args, "--grace-s") is not None, f"{where}: set --grace-s explicitly"
            pre_stop = container.get("lifecycle", {}).get("preStop", {})
            pre_stop_s = pre_stop.get("sleep", {}).get("seconds", 0)
            assert spec["terminationGracePeriodSeconds"] >= pre_stop_s + grace_s + 3, where


def test_tls_mounts_the_gateway_certificate(documents: dict[str, list[dict[str, Any]]]) -> None:
    gateway = _find(documents["cpu-demo-tls"], "Deployment", "pagewire-gateway")
    spec = gateway["spec"]["template"]["spec"]
    [container] = spec["containers"]
    assert _flag(container["args"], "--tls-cert") == "/etc/pagewire/tls/tls.crt"
    assert _flag(container["args"], "--tls-key") == "/etc/pagewire/tls/tls.key"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[mounts["/etc/pagewire/tls"]]["secret"]["secretName"] == "pagewire-gateway-tls"
    for name in ("pagewire-block-service", "pagewire-runner"):
        workload = next(w for w in _workloads(documents["cpu-demo-tls"])
                        if w["metadata"]["name"] == name)
        assert "--tls-cert" not in workload["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize("overlay", list(KUSTOMIZATIONS))
def test_every_flag_parses(documents: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    """Each service's own parser takes the args the manifests give it (a renamed flag fails
    here, not in a cluster). $(POD_IP) stands for an address the kubelet substitutes."""
    from block_service.__main__ import parse_args as block_service_args
    from gateway.server import build_parser as gateway_parser
    from gpu_runner.__main__ import parse_args as runner_args

    parsers: dict[str, Callable[[list[str]], argparse.Namespace]] = {
        "block_service": block_service_args,
        "gpu_runner": runner_args,
        "gateway": gateway_parser().parse_args,
    }
    for workload in _workloads(documents[overlay]):
        for role, container in _containers(workload):
            if role == "init":
                continue
            module, *args = (arg.replace("$(POD_IP)", "10.0.0.7") for arg in container["args"])
            parsed = parsers[module](args)
            assert parsed.host == "10.0.0.7"
