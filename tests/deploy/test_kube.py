"""tests/deploy/kube.py: the kubelet's `$(VAR)` expansion and Service link variables."""

from __future__ import annotations

from tests.deploy.kube import expand, service_link_env


def test_expand_follows_kubernetes_rules() -> None:
    lookup = {"POD_IP": "10.0.0.7", "EMPTY": ""}.get
    assert expand("$(POD_IP):50053", lookup) == "10.0.0.7:50053"
    assert expand("$(EMPTY)x", lookup) == "x"
    assert expand("$(UNSET)", lookup) == "$(UNSET)"  # undefined: left as written
    assert expand("$$(POD_IP)", lookup) == "$(POD_IP)"  # $$ escapes
    assert expand("a$b $ $(", lookup) == "a$b $ $("  # a lone $ or unclosed $( stays
    assert expand("$(POD_IP)$(POD_IP)", lookup) == "10.0.0.710.0.0.7"


def test_service_links_name_every_port_of_a_cluster_ip_service() -> None:
    services = [
        {"metadata": {"name": "pagewire-block-service", "namespace": "pw"},
         "spec": {"ports": [{"name": "grpc", "port": 50052}, {"name": "metrics", "port": 9090}]}},
        {"metadata": {"name": "pagewire-runner", "namespace": "pw"},
         "spec": {"clusterIP": "None", "ports": [{"port": 50053}]}},
    ]
    env = service_link_env(services, "pw", lambda name: "10.96.0.5")
    assert env["PAGEWIRE_BLOCK_SERVICE_SERVICE_HOST"] == "10.96.0.5"
    assert env["PAGEWIRE_BLOCK_SERVICE_PORT"] == "tcp://10.96.0.5:50052"
    assert env["PAGEWIRE_BLOCK_SERVICE_SERVICE_PORT_METRICS"] == "9090"
    assert env["PAGEWIRE_BLOCK_SERVICE_PORT_9090_TCP_ADDR"] == "10.96.0.5"
    assert not any(key.startswith("PAGEWIRE_RUNNER_") for key in env)  # headless: none
