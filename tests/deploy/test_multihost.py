"""The cluster on separate "hosts" without a cluster, started exactly as the manifests say.

`kubectl kustomize deploy/overlays/cpu-demo` is read the way the kubelet reads it: for the
block service, the two runners of the StatefulSet and the two gateway replicas, each main
container's args (the image's ENTRYPOINT is `python -m`), env (`fieldRef` values, `$(VAR)`
expansion with Kubernetes' rules, Service links unless turned off), volume mounts, ports and
probes. Each pod is a network namespace on a Linux bridge with its own address (no loopback
between services), Service names resolve through /etc/netns/NAME/hosts (a Service name maps
to one pod's IP: there is no kube-proxy), and each process runs by pod_launcher.py in its own
mount namespace with every volume at its mountPath and, as the manifests ask, a read-only root
file system. Then greedy streams through both gateways (gRPC and HTTP) equal transformers',
and a runner's host lost mid-stream loses no stream: its work moves to the other runner once
its registration lease runs out, within seconds. The host is lost two ways: its process killed
and then its link down (the dying process's connections close, so gateways see a FIN at
once), or its link down with the process still running (a power loss or partition as the
gateways see it: no FIN, no RST, the connections stay open, and only the gateways' gRPC
keepalive ends the Execute in flight there before its 120 s deadline).

What is not emulated, by design:
- The initContainer `install-model` (the default model converted into /models/default) does
  not run: /models holds a tiny random Qwen3 at /models/default instead. Installing the model
  is the image's step, tested with the image.
- The image itself: the processes run this checkout's venv, with the image's ENV (Dockerfile)
  mapped onto this machine (image_env), as root: `runAsUser`/`runAsNonRoot`, dropped
  capabilities and seccomp need the image's user and a container runtime.
- NetworkPolicies, resource limits and Service virtual IPs (each Service name resolves to
  one pod's IP).
"""

from __future__ import annotations

import json
import random
import secrets
import shutil
import socket
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.registration import DEFAULT_LEASE_MS
from common.security import open_channel
from common.server import EventLoopThread, ServerOptions, start_server
from gateway.client import PagewireClient
from gateway.server import _CHANNEL_OPTIONS
from gateway.tokenizer import Tokenizer
from protos import block_pb2, block_pb2_grpc
from tests.deploy import kube
from tests.deploy.pods import Hosts, Pod, can_create_namespaces
from tests.e2e.oracle import greedy
from tests.faults.conftest import VOCAB_HIGH, VOCAB_LOW, StreamBatch, wait_for
from tests.helpers.services import health_status
from tests.helpers.tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
OVERLAY = ROOT / "deploy" / "overlays" / "cpu-demo"
BLOCK_SERVICE = ("Deployment", "pagewire-block-service")
RUNNER = ("StatefulSet", "pagewire-runner")
GATEWAY = ("Deployment", "pagewire-gateway")
MODEL_MOUNT = "/models"  # the volume the initContainer fills (a tiny model here)
# The runtime stage's ENV in the Dockerfile, with this machine's paths for the image's: the
# venv's python, and the CPU kernel as built here (the image builds it into a read-only
# TORCH_EXTENSIONS_DIR; here it is this machine's build, read-only under the pod's root).
# Where the image's paths are on this machine: its venv is the project's, its prebuilt kernel
# the one `make setup` built here (torch's default folder).
IMAGE_PATHS = {
    "/opt/pagewire/venv/bin:${PATH}": f"{Path(sys.executable).parent}:/usr/local/sbin:"
                                      "/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "/opt/pagewire/venv": str(ROOT / ".venv"),
    "/opt/pagewire/torch_extensions": str(Path.home() / ".cache" / "torch_extensions"
                                          / "py311_cpu"),
}
# The kernel here was built for this CPU (-march=native), not the image's portable target.
NOT_MAPPED = {"PAGEWIRE_CPU_KERNEL_MARCH"}


def image_env() -> dict[str, str]:
    """The ENV of the Dockerfile's runtime stage, its paths mapped onto this machine
    (IMAGE_PATHS): read from the Dockerfile, so the processes get what the image sets."""
    lines = (ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
    runtime = lines[max(i for i, line in enumerate(lines) if line.startswith("FROM ")):]
    env = {}
    for line in runtime:
        if line.startswith("ENV "):
            for pair in line[4:].split():
                key, _, value = pair.partition("=")
                env[key] = IMAGE_PATHS.get(value, value)
    unmapped = [f"{k}={v}" for k, v in env.items()
                if k not in NOT_MAPPED and ("/opt/" in v or "${" in v)]
    assert not unmapped, f"image paths this test cannot map (see IMAGE_PATHS): {unmapped}"
    return {k: v for k, v in env.items() if k not in NOT_MAPPED}
NUM_STREAMS = 8
MAX_TOKENS = 24
LONG_MAX_TOKENS = 200
# The longest a stream may stall when its runner's host is lost: the runner's registration
# lease and the gateways' keepalive (a ping after 2 s without a byte from the runner, 2 s for
# its answer: gateway/server.py) run side by side from the cut, then the other runner
# recomputes the moved sequences; the rest is margin for a loaded machine. Without keepalive a
# partitioned runner stalls its streams for the Execute's deadline (120 s).
STALL_LIMIT_S = DEFAULT_LEASE_MS / 1000 + 4.0 + 5.0


def _timing(what: str, seconds: float) -> None:
    print(f"[multihost timing] {what}: {seconds:.2f} s", flush=True)


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[Hosts]:
    why_not = can_create_namespaces()
    if shutil.which("kubectl") is None:
        why_not = "needs kubectl (kubectl kustomize renders the manifests)"
    if why_not:
        pytest.skip(f"cannot emulate hosts here: {why_not}")
    running = Hosts(tmp_path / "pods")
    running.work_dir.mkdir()
    try:
        yield running
    finally:
        running.close()


class Deployment:
    """The rendered manifests laid out on `hosts`: pod names, IPs, names, volumes."""

    def __init__(self, hosts: Hosts, tmp_path: Path) -> None:
        self.hosts = hosts
        self.objects = kube.render(OVERLAY)
        self.tmp_path = tmp_path
        self.models = tmp_path / "models"
        self.model = make_tiny_model("qwen3", self.models / "default")
        self.token = secrets.token_urlsafe(32)
        # Deployment pods get a random suffix, StatefulSet pods an ordinal.
        self.block = hosts.add_pod("pagewire-block-service-5f7c9-x2k4q")
        self.runners = [hosts.add_pod(f"pagewire-runner-{i}") for i in range(2)]
        self.gateways = [hosts.add_pod(f"pagewire-gateway-7d8b6-{c}") for c in ("a1b2c",
                                                                                 "d3e4f")]
        self.namespace = kube.find(self.objects, *BLOCK_SERVICE)["metadata"].get(
            "namespace", "default")
        self.service_ip = {"pagewire-block-service": self.block.ip,
                           "pagewire-gateway": self.gateways[0].ip}
        self.plans = {pod.name: kube.pod_plan(self.objects, *workload, pod.name, pod.ip,
                                              self.service_ip.__getitem__)
                      for workload, pods in ((BLOCK_SERVICE, [self.block]),
                                             (RUNNER, self.runners),
                                             (GATEWAY, self.gateways))
                      for pod in pods}
        names = self._names()
        search = [f"{self.namespace}.svc.cluster.local", "svc.cluster.local", "cluster.local"]
        for pod in hosts.pods:
            hosts.write_name_files(pod, names, search)

    def _names(self) -> dict[str, str]:
        """Every Service's names (short to FQDN) -> its IP; a runner pod's headless names."""
        names: dict[str, str] = {}
        ns = self.namespace
        forms = ("{}", "{}." + ns, "{}." + ns + ".svc", "{}." + ns + ".svc.cluster.local")
        for service, ip in self.service_ip.items():
            names.update({form.format(service): ip for form in forms})
        headless = kube.find(self.objects, *RUNNER)["spec"]["serviceName"]
        for pod in self.runners:
            names.update({form.format(f"{pod.name}.{headless}"): pod.ip for form in forms})
        return names

    def _secret_dir(self, volume: kube.Volume) -> Path:
        """The Secret's keys as files, each holding this run's token."""
        spec = volume.source["secret"]
        folder = self.tmp_path / "secrets" / spec["secretName"]
        if folder.exists():
            return folder
        folder.mkdir(parents=True)
        try:
            secret = kube.find(self.objects, "Secret", spec["secretName"])
            keys = [*secret.get("data", {}), *secret.get("stringData", {})]
        except LookupError:
            keys = ["token"]
        paths = {item["key"]: item["path"] for item in spec.get("items", [])} or {
            key: key for key in keys}
        for path in paths.values():
            (folder / path).write_text(self.token + "\n")
            (folder / path).chmod(spec.get("defaultMode", 0o644))
        return folder

    def mounts(self, pod: Pod) -> list[dict[str, object]]:
        plan = self.plans[pod.name]
        mounts: list[dict[str, object]] = []
        for volume in plan.volumes:
            if volume.path == MODEL_MOUNT:
                source = self.models
            elif volume.kind == "emptyDir":
                source = self.tmp_path / "emptydir" / pod.name / volume.name
                source.mkdir(parents=True)
            elif volume.kind == "secret":
                source = self._secret_dir(volume)
            elif volume.kind == "persistentVolumeClaim":
                source = self.tmp_path / "pvc" / volume.source[volume.kind]["claimName"]
                source.mkdir(parents=True, exist_ok=True)
            else:
                raise NotImplementedError(f"{pod.name}: volume {volume.name}: {volume.kind}")
            if volume.sub_path:
                source = source / volume.sub_path
            mounts.append({"source": str(source), "target": volume.path,
                           "read_only": volume.read_only})
        return mounts

    def start(self, pod: Pod) -> None:
        plan = self.plans[pod.name]
        env = {**image_env(), "HOSTNAME": pod.name, **plan.env}
        self.hosts.start(pod, plan, self.mounts(pod), env)

    def probes_pass(self, pod: Pod) -> bool:
        """Whether every probe of the pod's container passes now (as the kubelet asks them:
        at the pod IP)."""
        for probe in self.plans[pod.name].probes.values():
            address = f"{pod.ip}:{probe.port}"
            if probe.kind == "grpc":
                if health_status(address) != health_pb2.HealthCheckResponse.SERVING:
                    return False
            elif probe.kind == "tcpSocket":
                try:
                    socket.create_connection((pod.ip, probe.port), timeout=1).close()
                except OSError:
                    return False
            elif probe.kind == "httpGet":
                try:
                    with urllib.request.urlopen(f"http://{address}{probe.path}",
                                                timeout=1) as reply:
                        if not 200 <= reply.status < 400:
                            return False
                except OSError:
                    return False
        return True

    def wait_ready(self, pods: list[Pod], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = list(pods)
        while waiting:
            for pod in list(waiting):
                assert pod.process is not None
                if pod.process.poll() is not None:
                    raise AssertionError(f"{pod.name} exited {pod.process.returncode}:\n"
                                         f"{pod.log()}")
                if self.probes_pass(pod):
                    waiting.remove(pod)
                    _timing(f"start-up of {pod.name} (to every probe passing)",
                            time.monotonic() - pod.started_at)
            assert time.monotonic() < deadline, (
                f"not ready within {timeout_s} s: " + "; ".join(
                    f"{p.name}:\n{p.log()}" for p in waiting))
            time.sleep(0.1)

    def block_stub(self) -> block_pb2_grpc.BlockServiceStub:
        port = self.plans[self.block.name].port("grpc")
        return block_pb2_grpc.BlockServiceStub(
            open_channel(f"{self.block.ip}:{port}", token=self.token))


def _random_prompts(rng: random.Random, count: int) -> list[list[int]]:
    return [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(5, 40))]
            for _ in range(count)]


def _http_completion(address: str, prompt: list[int]) -> dict[str, object]:
    with urllib.request.urlopen(f"http://{address}/v1/models", timeout=10) as reply:
        model = json.load(reply)["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                       "temperature": 0, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"http://{address}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.load(reply)  # type: ignore[no-any-return]


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["killed", "partitioned"])
def test_cluster_on_separate_hosts_as_the_manifests_say(hosts: Hosts, tmp_path: Path,
                                                        loss: str) -> None:
    deployment = Deployment(hosts, tmp_path)
    block, runners, gateways = deployment.block, deployment.runners, deployment.gateways
    plans = deployment.plans

    # Start-up in the manifests' order of dependence; every probe on the pod IP.
    began = time.monotonic()
    deployment.start(block)
    deployment.wait_ready([block], 60)
    for runner in runners:
        deployment.start(runner)
    deployment.wait_ready(runners, 180)
    blocks = deployment.block_stub()
    advertised = {f"{r.ip}:{plans[r.name].port('grpc')}" for r in runners}
    wait_for(lambda: advertised <= {
        r.pool.address for r in blocks.ListRunners(block_pb2.ListRunnersRequest(),
                                                    timeout=5).runners}, 15)
    for gateway in gateways:
        deployment.start(gateway)
    deployment.wait_ready(gateways, 120)
    _timing("whole cluster up", time.monotonic() - began)

    # Nothing listens on loopback: every socket of every pod is on its pod IP.
    for pod in hosts.pods:
        listening = pod.listening()
        # gRPC listens on an IPv6 socket: the pod IP then reads [::ffff:IP].
        on_pod_ip = (f"{pod.ip}:", f"[::ffff:{pod.ip}]:")
        assert listening and all(a.startswith(on_pod_ip) for a in listening), (
            pod.name, listening)
        ports = {int(a.rsplit(":", 1)[1]) for a in listening}
        assert set(plans[pod.name].ports.values()) <= ports, (pod.name, listening)

    # Greedy streams through both gateways' gRPC ports and HTTP ports equal transformers'.
    clients = [PagewireClient(f"{g.ip}:{plans[g.name].port('grpc')}") for g in gateways]
    http = [f"{g.ip}:{plans[g.name].port('http')}" for g in gateways]
    rng = random.Random(11)
    prompts = _random_prompts(rng, NUM_STREAMS)
    try:
        def run(i: int) -> list[int] | str:
            if i < len(http):
                answer = _http_completion(http[i], prompts[i])
                usage = answer["usage"]
                assert isinstance(usage, dict) and usage["completion_tokens"] == MAX_TOKENS
                choice = answer["choices"][0]  # type: ignore[index]
                return str(choice["text"])
            result = clients[i % 2].complete(token_ids=prompts[i], max_tokens=MAX_TOKENS,
                                             temperature=0, ignore_eos=True, timeout=120)
            return list(result.token_ids[0])

        with ThreadPoolExecutor(NUM_STREAMS) as pool:
            results = list(pool.map(run, range(NUM_STREAMS)))
        tokenizer = Tokenizer(deployment.model)
        for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
            expected = greedy(prompt, MAX_TOKENS, model=deployment.model)
            if isinstance(result, str):
                assert result == tokenizer.decode(expected), f"HTTP request {i}"
            else:
                assert result == expected, f"stream {i}"
        placed = {r.pool.address: r for r in blocks.ListRunners(
            block_pb2.ListRunnersRequest(), timeout=5).runners}
        assert set(placed) == advertised

        # A runner's host goes away mid-stream: every stream ends with transformers' tokens.
        long_prompts = _random_prompts(rng, NUM_STREAMS)
        batches = [StreamBatch(client, long_prompts[i::2], max_tokens=LONG_MAX_TOKENS)
                   for i, client in enumerate(clients)]
        records = [r for batch in batches for r in batch.records]
        ordered = [p for i in range(2) for p in long_prompts[i::2]]
        metrics_port = plans[gateways[0].name].ports.get("metrics")

        def running_on(runner: Pod) -> float:
            address = f"{runner.ip}:{plans[runner.name].port('grpc')}"
            if metrics_port is not None:
                return sum(scrape_metric_at(g.ip, metrics_port,
                                            "pagewire_gateway_running_sequences",
                                            runner=address) for g in gateways)
            stats = blocks.GetStats(block_pb2.GetStatsRequest(pool_id=address), timeout=5)
            return float(stats.stats.num_sequences)

        wait_for(lambda: all(running_on(r) > 0 for r in runners), 60, poll_s=0.1)
        for batch in batches:
            batch.wait_until_each_has(4)
        victim = runners[0]
        victim_port = plans[victim.name].port("grpc")
        cut_at = time.monotonic()
        tokens_before = [len(r.tokens) for r in records]
        if loss == "killed":
            hosts.cut(victim)
        else:
            hosts.partition(victim)
            # Nothing reached the gateways: the runner still runs and their connections to it
            # are open (a FIN or RST would have closed them at once); they must find out.
            assert victim.process is not None and victim.process.poll() is None
            open_to_victim = {g.name: g.connections_to(victim.ip, victim_port)
                              for g in gateways}
            assert all(open_to_victim.values()), open_to_victim
        for batch in batches:
            batch.join(timeout_s=180)
        stalls = [r.longest_gap(cut_at, cut_at + 150) for r in records]
        _timing(f"runner {loss}: stall (longest token gap across the cut, worst stream)",
                max(stalls))
        _timing(f"runner {loss}: cut to the end of the last stream",
                max(r.ended_at for r in records) - cut_at)
        for i, (prompt, record) in enumerate(zip(ordered, records, strict=True)):
            assert record.error is None, f"stream {i}: {record.error}: {record.error_message}"
            assert record.tokens == greedy(prompt, LONG_MAX_TOKENS, model=deployment.model), (
                f"stream {i} differs from transformers")
        assert max(stalls) < STALL_LIMIT_S, (
            f"a stream stalled {max(stalls):.1f} s when its runner was {loss}")
        assert any(len(r.tokens) > before for r, before in zip(records, tokens_before,
                                                                 strict=True))
        live = {r.pool.address for r in blocks.ListRunners(block_pb2.ListRunnersRequest(),
                                                           timeout=5).runners}
        assert live == advertised - {f"{victim.ip}:{plans[victim.name].port('grpc')}"}
        moved = sum(scrape_metric_at(g.ip, metrics_port, "pagewire_gateway_moved_requests_total")
                    for g in gateways) if metrics_port is not None else None
        print(f"[multihost] requests moved: {moved}", flush=True)
        assert moved is None or moved > 0
    finally:
        for client in clients:
            client.close()


# How long a call stays open with nothing sent: gRPC's default server policy answers the
# gateway's 2 s pings with GOAWAY "too_many_pings" after about 8 s on a connection without
# calls, and fails a call open that long after about 10 s.
QUIET_CALL_S = 12.0


def _quiet(request: bytes, _context: grpc.ServicerContext) -> bytes:
    time.sleep(QUIET_CALL_S)
    return request


def _takes_pings(loop: EventLoopThread | None) -> None:
    """A server as start_server builds it (asyncio with `loop`) takes the gateway's pings:
    on a call open for QUIET_CALL_S with nothing sent, and on a connection without calls."""
    handler = grpc.method_handlers_generic_handler(
        "pagewire.test.Quiet", {"Call": grpc.unary_unary_rpc_method_handler(_quiet)})
    service = start_server(ServerOptions(), lambda server: server.add_generic_rpc_handlers(
        (handler,)), [], loop=loop.loop if loop is not None else None)
    address = f"127.0.0.1:{service.port}"
    # Two connections: channels with the same options share one (gRPC's subchannel pool).
    busy = open_channel(address, options=_CHANNEL_OPTIONS)
    idle = open_channel(address, options=[*_CHANNEL_OPTIONS, ("pagewire.test.idle", 1)])
    states: list[grpc.ChannelConnectivity] = []
    try:
        health_pb2_grpc.HealthStub(idle).Check(health_pb2.HealthCheckRequest(), timeout=5)
        idle.subscribe(states.append)
        # Fails UNAVAILABLE "Too many pings" where the server refuses them.
        busy.unary_unary("/pagewire.test.Quiet/Call")(b"", timeout=QUIET_CALL_S + 10)
        # The idle connection stayed up all along (a GOAWAY turns the channel IDLE).
        assert states and set(states) == {grpc.ChannelConnectivity.READY}, states
    finally:
        idle.unsubscribe(states.append)
        busy.close()
        idle.close()
        service.stop(0)


def test_servers_take_the_gateways_keepalive_pings() -> None:
    """Keepalive finds a partitioned runner only if the servers let the gateway ping: both
    kinds of server start_server builds (threaded, asyncio) take the gateway's keepalive
    pings (gateway/server.py) without GOAWAY "too_many_pings", while a call is open and
    nothing is sent (a long Execute) and on a connection without calls. Needs no root."""
    loop = EventLoopThread()
    try:
        with ThreadPoolExecutor(2) as pool:
            for done in [pool.submit(_takes_pings, None), pool.submit(_takes_pings, loop)]:
                done.result()
    finally:
        loop.stop()


def scrape_metric_at(host: str, port: int, name: str, **labels: str) -> float:
    """Sum of a metric's samples carrying `labels` on http://host:port/metrics (0 when none;
    tests.helpers.services.scrape_metric reads loopback only)."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    total = 0.0
    for line in text.splitlines():
        if not (line.startswith(name + " ") or line.startswith(name + "{")):
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
