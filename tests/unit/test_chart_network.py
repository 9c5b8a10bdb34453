"""The chart's NetworkPolicies against the intended role matrix.

The rendered policies are evaluated by a small model of NetworkPolicy semantics
(`admits`, `connects`): a pod selected by a policy of a direction is isolated in
that direction and admits only what some rule of those policies allows; a
connection needs the source's egress and the destination's ingress. Selectors
(matchLabels, matchExpressions), namespaceSelector, ipBlock, named and numbered
ports, endPort and protocols are modelled; ipBlock is taken to match addresses
outside the cluster only, the one reading of it every CNI shares. This checks
what the manifests say, not what a CNI enforces.

Every pair of endpoints with a release pod on either side is checked on every
port of interest: what the matrix allows is allowed, everything else is denied.
"""

from __future__ import annotations

import ipaddress
import itertools
from dataclasses import dataclass, field

import pytest
import yaml

from tests.unit.test_chart import CHART, by_kind, render

NAMESPACE = "ml"
ROLES = ("api", "scheduler", "replay", "worker", "sandbox", "redis")
RELEASE_LABELS = {"app.kubernetes.io/name": "reflow", "app.kubernetes.io/instance": "rl"}


@dataclass(frozen=True)
class Endpoint:
    """A pod (`namespace` set, with its labels and named ports) or an address
    outside the cluster (`namespace` None)."""

    name: str
    namespace: str | None = None
    labels: dict = field(default_factory=dict, hash=False)
    ports: dict = field(default_factory=dict, hash=False)  # name -> (port, protocol)
    ip: str = "10.244.0.1"


def namespace_labels(namespace: str) -> dict:
    return {"kubernetes.io/metadata.name": namespace}


# -- The evaluator -------------------------------------------------------------

def selects(selector: dict | None, labels: dict) -> bool:
    """A LabelSelector: matchLabels and matchExpressions, all must hold; {} selects all."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels,
              "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def peer_matches(peer: dict, policy_namespace: str, other: Endpoint) -> bool:
    if "ipBlock" in peer:
        if other.namespace is not None:
            return False
        block = peer["ipBlock"]
        address = ipaddress.ip_address(other.ip)
        inside = address in ipaddress.ip_network(block["cidr"], strict=False)
        return inside and not any(address in ipaddress.ip_network(e, strict=False)
                                  for e in block.get("except") or [])
    if other.namespace is None:
        return False  # pod and namespace selectors match pods only
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], namespace_labels(other.namespace)):
            return False
    elif other.namespace != policy_namespace:
        return False  # a podSelector alone means the policy's own namespace
    return "podSelector" not in peer or selects(peer["podSelector"], other.labels)


def port_matches(entry: dict, dst: Endpoint, port: int, protocol: str) -> bool:
    if entry.get("protocol", "TCP") != protocol:
        return False
    if "port" not in entry:
        return True  # every port of the protocol
    wanted = entry["port"]
    if isinstance(wanted, str):  # a named port, looked up on the destination pod
        return dst.ports.get(wanted) == (port, protocol)
    return wanted <= port <= entry.get("endPort", wanted)


def policy_types(spec: dict) -> list[str]:
    if "policyTypes" in spec:
        return spec["policyTypes"]
    return ["Ingress", "Egress"] if "egress" in spec else ["Ingress"]


def admits(policies: list[dict], pod: Endpoint, other: Endpoint, port: int, protocol: str,
           direction: str) -> bool:
    """Whether `pod`'s policies let through traffic with `other` in `direction`
    ("Ingress": other connects to pod on `port`; "Egress": pod connects to other)."""
    if pod.namespace is None:
        return True  # outside the cluster: no policy of ours applies
    key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    dst = pod if direction == "Ingress" else other
    isolated = False
    for policy in policies:
        spec = policy["spec"]
        if policy["metadata"].get("namespace", NAMESPACE) != pod.namespace:
            continue
        if not selects(spec["podSelector"], pod.labels) or direction not in policy_types(spec):
            continue
        isolated = True
        for rule in spec.get(key) or []:
            peers = rule.get(peers_key) or []
            ports = rule.get("ports") or []
            if peers and not any(peer_matches(p, pod.namespace, other) for p in peers):
                continue
            if ports and not any(port_matches(e, dst, port, protocol) for e in ports):
                continue
            return True
    return not isolated


def connects(policies: list[dict], src: Endpoint, dst: Endpoint, port: int,
             protocol: str = "TCP") -> bool:
    return (admits(policies, src, dst, port, protocol, "Egress")
            and admits(policies, dst, src, port, protocol, "Ingress"))


# -- The world the policies are checked in --------------------------------------

def release_pods(docs: list[dict], **extra_labels) -> dict[str, Endpoint]:
    """Each role's pod, from its rendered pod template (labels, container ports)."""
    pods = {}
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        template = doc["spec"]["template"]
        labels = {**template["metadata"]["labels"]}
        role = labels["app.kubernetes.io/component"]
        if role == "worker":
            labels.update(extra_labels)
        ports = {p["name"]: (p["containerPort"], p.get("protocol", "TCP"))
                 for c in template["spec"]["containers"] for p in c.get("ports", [])}
        pods[role] = Endpoint(role, NAMESPACE, labels, ports)
    return pods


def outsiders() -> dict[str, Endpoint]:
    return {
        "prometheus": Endpoint("prometheus", "monitoring", {"app": "prometheus"}),
        "dns": Endpoint("dns", "kube-system", {"k8s-app": "kube-dns"}, {"dns": (53, "UDP")}),
        "dns-elsewhere": Endpoint("dns-elsewhere", "other", {"k8s-app": "kube-dns"}),
        "ingress": Endpoint("ingress", "ingress-nginx", {"app": "ingress-nginx"}),
        "stranger": Endpoint("stranger", NAMESPACE, {"app": "stranger"}),
        # Another release of the chart in the same namespace: not a peer.
        "other-release": Endpoint("other-release", NAMESPACE, {
            "app.kubernetes.io/name": "reflow", "app.kubernetes.io/instance": "rl2",
            "app.kubernetes.io/component": "worker"}),
        "other-ns": Endpoint("other-ns", "other", {"app": "x"}),
        "kube-api": Endpoint("kube-api", ip="10.0.0.1"),
        "internet": Endpoint("internet", ip="203.0.113.7"),
    }


def port_of(pods: dict[str, Endpoint], role: str, name: str) -> int:
    return pods[role].ports[name][0]


EPHEMERAL = 41234  # a TCPStore or gloo/NCCL port picked by the kernel
HEALTH = 50070


def probe_ports(pods: dict[str, Endpoint]) -> list[tuple[int, str]]:
    declared = {p for pod in pods.values() for p in pod.ports.values()}
    return sorted(declared | {(53, "TCP"), (53, "UDP"), (443, "TCP"), (6443, "TCP"),
                              (6380, "TCP"), (EPHEMERAL, "TCP"), (EPHEMERAL, "UDP"),
                              (HEALTH, "TCP"), (22, "TCP")})


def intended(pods: dict[str, Endpoint], src: str, dst: str, port: int, protocol: str,
             direction: str, *, api_from: set[str] | None = None,
             kube_api: set[str] | None = None, external_redis: int | None = None) -> bool:
    """The matrix the chart promises (docs/kubernetes.md, "Network policy"), one side at a time:
    "Egress", what release pod `src` may open; "Ingress", what release pod `dst`
    accepts. Each side enforces the matrix on its own (egress mirrors ingress).
    `api_from`: the endpoints the API accepts (None: any source); `kube_api`: where
    the scheduler may reach the Kubernetes API (None: any address on 443 and 6443,
    pods included); `external_redis`: the port of a Redis outside the release,
    at any address."""
    api, sched = port_of(pods, "api", "http"), port_of(pods, "scheduler", "grpc")
    replay, worker = port_of(pods, "replay", "grpc"), port_of(pods, "worker", "grpc")
    metrics = port_of(pods, "api", "metrics")
    redis = port_of(pods, "redis", "redis") if "redis" in pods else None
    sandbox = port_of(pods, "sandbox", "grpc") if "sandbox" in pods else None
    if src == "sandbox" and direction == "Egress":
        return False  # it opens no connection, DNS included
    if protocol == "UDP":
        return direction == "Egress" and dst == "dns" and port == 53
    if src == "worker" and dst == "worker":
        return True  # weight sync, trainer group: every TCP port
    allowed = {
        ("api", "scheduler"): {sched},
        ("scheduler", "replay"): {replay},
        ("worker", "replay"): {replay},
        ("scheduler", "worker"): {worker},
        ("scheduler", "redis"): {redis},
        ("replay", "redis"): {redis},
        ("worker", "sandbox"): {sandbox},
    }
    if port in allowed.get((src, dst), ()):
        return True
    if direction == "Egress":
        if src == "scheduler" and port in (443, 6443) and (kube_api is None or dst in kube_api):
            return True
        if src in ("scheduler", "replay") and port == external_redis:
            return True
        return dst == "dns" and port == 53
    if dst == "api" and port == api:
        return api_from is None or src in api_from
    return src == "prometheus" and port == metrics and dst != "redis"


def check_matrix(docs: list[dict], **expected) -> int:
    """Every pair with a release pod on a side, every port, each side's verdict
    (the source's egress, the destination's ingress) the intended one, whatever
    role label the workers carry. Returns the verdicts checked."""
    policies = list(by_kind(docs, "NetworkPolicy").values())
    checked = 0
    for role_label in ("idle", "rollout", "trainer"):
        pods = release_pods(docs, **{"reflow.io/role": role_label})
        world = {**pods, **outsiders()}
        ports = probe_ports(pods)
        wrong = []
        for (a, src), (b, dst) in itertools.product(world.items(), repeat=2):
            for port, protocol in ports:
                for direction, pod, other in (("Egress", src, dst), ("Ingress", dst, src)):
                    if pod.name not in pods:
                        continue
                    want = intended(pods, a, b, port, protocol, direction, **expected)
                    got = admits(policies, pod, other, port, protocol, direction)
                    checked += 1
                    if got != want:
                        wrong.append(f"{direction.lower()} of {a} -> {b}:{port}/{protocol} "
                                     f"{'allowed' if got else 'denied'}, intended "
                                     f"{'allowed' if want else 'denied'}")
        assert not wrong, f"reflow.io/role={role_label}:\n" + "\n".join(wrong)
    return checked


# -- The tests -------------------------------------------------------------------

def test_the_evaluator_reads_selectors_peers_and_ports_as_kubernetes_does():
    assert selects({}, {"a": "1"}) and selects(None, {})
    assert selects({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1"]}]},
                   {"a": "1"})
    assert not selects({"matchExpressions": [{"key": "a", "operator": "NotIn",
                                              "values": ["1"]}]}, {"a": "1"})
    assert selects({"matchExpressions": [{"key": "b", "operator": "DoesNotExist"}]}, {"a": "1"})
    assert not selects({"matchExpressions": [{"key": "b", "operator": "Exists"}]}, {"a": "1"})
    pod = Endpoint("p", NAMESPACE, {"app": "x"}, {"web": (8080, "TCP")})
    there = Endpoint("q", "other", {"app": "x"})
    assert peer_matches({"podSelector": {}}, NAMESPACE, pod)
    assert not peer_matches({"podSelector": {}}, NAMESPACE, there)
    assert peer_matches({"namespaceSelector": {}}, NAMESPACE, there)
    assert not peer_matches({"ipBlock": {"cidr": "0.0.0.0/0"}}, NAMESPACE, pod)
    outside = Endpoint("o", ip="192.0.2.9")
    assert peer_matches({"ipBlock": {"cidr": "192.0.2.0/24"}}, NAMESPACE, outside)
    assert not peer_matches({"ipBlock": {"cidr": "192.0.2.0/24", "except": ["192.0.2.8/29"]}},
                            NAMESPACE, outside)
    assert port_matches({"port": "web"}, pod, 8080, "TCP")
    assert not port_matches({"port": "web"}, pod, 8081, "TCP")
    assert port_matches({"port": 8000, "endPort": 8100}, pod, 8080, "TCP")
    assert not port_matches({"port": 8080}, pod, 8080, "UDP")
    assert port_matches({"protocol": "UDP"}, pod, 9, "UDP")
    # No policy: open; a policy with no rules: isolated, nothing admitted.
    deny = {"metadata": {"name": "d"}, "spec": {"podSelector": {}, "policyTypes": ["Egress"]}}
    assert connects([], pod, outside, 1)
    assert not connects([deny], pod, outside, 1)
    assert connects([deny], outside, pod, 8080)


def test_the_default_release_allows_the_intended_matrix_and_denies_everything_else():
    docs, _ = render({})
    assert set(by_kind(docs, "NetworkPolicy")) == {f"rl-reflow-{r}" for r in ROLES}
    assert check_matrix(docs) > 3000


def test_the_matrix_check_catches_the_old_flat_policy_and_a_widened_rule():
    docs, _ = render({})
    others = [d for d in docs if d["kind"] != "NetworkPolicy"]
    flat = {"kind": "NetworkPolicy", "metadata": {"name": "rl-reflow-internal"}, "spec": {
        "podSelector": {"matchLabels": RELEASE_LABELS}, "policyTypes": ["Ingress"],
        "ingress": [{"from": [{"podSelector": {"matchLabels": RELEASE_LABELS}}]}]}}
    with pytest.raises(AssertionError, match="ingress of worker -> redis:6379/TCP allowed"):
        check_matrix([*others, flat])
    widened = yaml.safe_load(yaml.safe_dump(docs))
    worker = next(d for d in widened if d["metadata"]["name"] == "rl-reflow-worker")
    del worker["spec"]["egress"][1]["ports"]  # replay on every port
    with pytest.raises(AssertionError, match="egress of worker -> replay:9090/TCP allowed"):
        check_matrix(widened)


def test_every_release_pod_is_isolated_both_ways_by_exactly_one_policy():
    docs, _ = render({})
    policies = list(by_kind(docs, "NetworkPolicy").values())
    pods = release_pods(docs)
    assert set(pods) == set(ROLES)
    for role, pod in pods.items():
        mine = [p for p in policies if selects(p["spec"]["podSelector"], pod.labels)]
        assert len(mine) == 1, role
        assert mine[0]["spec"]["policyTypes"] == ["Ingress", "Egress"]
        assert mine[0]["metadata"]["name"] == f"rl-reflow-{role}"


def test_the_worker_rules_hold_whatever_the_role_label_says():
    """The scheduler relabels workers at each flip; no rule may depend on it."""
    docs, _ = render({})
    for policy in by_kind(docs, "NetworkPolicy").values():
        assert "reflow.io/role" not in yaml.safe_dump(policy)


def test_the_named_denials_and_dns():
    docs, _ = render({})
    policies = list(by_kind(docs, "NetworkPolicy").values())
    pods, out = release_pods(docs), outsiders()
    ports = {r: {n: p for n, (p, _) in pod.ports.items()} for r, pod in pods.items()}
    assert not connects(policies, pods["worker"], pods["redis"], 6379)
    assert not connects(policies, pods["worker"], pods["scheduler"], ports["scheduler"]["grpc"])
    assert not connects(policies, pods["worker"], pods["api"], ports["api"]["http"])
    assert not connects(policies, pods["replay"], pods["worker"], ports["worker"]["grpc"])
    assert not connects(policies, pods["api"], pods["worker"], ports["worker"]["grpc"])
    assert not connects(policies, pods["api"], pods["redis"], 6379)
    assert not connects(policies, out["other-release"], pods["worker"], EPHEMERAL)
    assert not connects(policies, pods["worker"], out["other-release"], EPHEMERAL)
    for role in ROLES:
        resolves = role != "sandbox"
        assert connects(policies, pods[role], out["dns"], 53, "UDP") is resolves, role
        assert connects(policies, pods[role], out["dns"], 53, "TCP") is resolves, role
        assert not connects(policies, pods[role], out["dns-elsewhere"], 53, "UDP")
        assert not connects(policies, pods[role], out["internet"], 80)
    for role in ("api", "replay", "worker", "sandbox", "redis"):
        assert not connects(policies, pods[role], out["internet"], 443)
        assert not connects(policies, pods[role], out["kube-api"], 6443)
    assert connects(policies, pods["scheduler"], out["kube-api"], 6443)
    assert connects(policies, pods["worker"], pods["worker"], EPHEMERAL)
    # The sandbox: the workers in on its gRPC port, nothing out.
    assert connects(policies, pods["worker"], pods["sandbox"], ports["sandbox"]["grpc"])
    for role in ("api", "scheduler", "replay", "redis"):
        assert not connects(policies, pods[role], pods["sandbox"], ports["sandbox"]["grpc"])
    for role in ROLES:
        for port in (ports["sandbox"]["grpc"], EPHEMERAL, 6379, 53):
            assert not connects(policies, pods["sandbox"], pods[role], port), role
    assert not connects(policies, out["stranger"], pods["sandbox"], ports["sandbox"]["grpc"])
    assert not connects(policies, pods["worker"], pods["sandbox"], EPHEMERAL)


def test_narrowing_the_kubernetes_api_denies_the_scheduler_every_other_address():
    docs, _ = render({"networkPolicy": {"kubeApi": {"cidrs": ["10.0.0.1/32"], "ports": [6443]}}})
    policies = list(by_kind(docs, "NetworkPolicy").values())
    pods, out = release_pods(docs), outsiders()
    assert connects(policies, pods["scheduler"], out["kube-api"], 6443)
    assert not connects(policies, pods["scheduler"], out["kube-api"], 443)
    assert not connects(policies, pods["scheduler"], out["internet"], 6443)
    docs, _ = render({"networkPolicy": {"kubeApi": {"cidrs": ["10.0.0.1/32"]}}})
    check_matrix(docs, kube_api={"kube-api"})


def test_api_ingress_from_lets_in_only_the_peers_named():
    ingress_ns = [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "ingress-nginx"}}}]
    docs, _ = render({"networkPolicy": {"apiIngressFrom": ingress_ns}})
    api = by_kind(docs, "NetworkPolicy")["rl-reflow-api"]["spec"]
    assert api["ingress"][0]["from"] == ingress_ns
    check_matrix(docs, api_from={"ingress"})
    # The hardened CI values name the same namespace.
    hardened = yaml.safe_load((CHART / "ci" / "hardened-values.yaml").read_text())
    docs, _ = render(hardened)
    check_matrix(docs, api_from={"ingress"})


def test_external_redis_is_reached_by_the_scheduler_and_the_replay_buffer_only():
    values = yaml.safe_load((CHART / "ci" / "cpu-external-redis-values.yaml").read_text())
    docs, _ = render(values)
    policies = list(by_kind(docs, "NetworkPolicy").values())
    assert "rl-reflow-redis" not in by_kind(docs, "NetworkPolicy")
    pods, out = release_pods(docs), outsiders()
    assert "redis" not in pods
    check_matrix(docs, external_redis=6380)
    for role in ("scheduler", "replay"):
        assert connects(policies, pods[role], out["internet"], 6380)
        assert not connects(policies, pods[role], out["internet"], 6379)
    for role in ("api", "worker"):
        assert not connects(policies, pods[role], out["internet"], 6380)
    values["networkPolicy"] = {"externalRedisTo": [{"ipBlock": {"cidr": "192.0.2.10/32"}}]}
    docs, _ = render(values)
    policies = list(by_kind(docs, "NetworkPolicy").values())
    redis_host = Endpoint("redis-host", ip="192.0.2.10")
    for role in ("scheduler", "replay"):
        assert connects(policies, pods[role], redis_host, 6380)
        assert not connects(policies, pods[role], out["internet"], 6380)


@pytest.mark.parametrize("scope", ["all", "worker"])
def test_extra_egress_opens_only_what_it_names(scope):
    rule = {"to": [{"ipBlock": {"cidr": "203.0.113.0/24"}}], "ports": [{"port": 9000}]}
    docs, _ = render({"networkPolicy": {"extraEgress": {scope: [rule]}}})
    policies = list(by_kind(docs, "NetworkPolicy").values())
    pods, out = release_pods(docs), outsiders()
    for role in ROLES:
        # The sandbox opens nothing, extra rules for every pod included.
        expected = (scope == "all" and role != "sandbox") or role == "worker"
        assert connects(policies, pods[role], out["internet"], 9000) is expected, role
        assert connects(policies, pods[role], out["internet"], 80) is False, role
        assert connects(policies, pods[role], out["other-ns"], 9000) is False, role


def test_without_the_sandbox_the_workers_reach_no_sandbox_port():
    docs, _ = render({"sandbox": {"enabled": False}})
    assert "rl-reflow-sandbox" not in by_kind(docs, "NetworkPolicy")
    worker = by_kind(docs, "NetworkPolicy")["rl-reflow-worker"]
    assert "sandbox" not in yaml.safe_dump(worker["spec"]["egress"])
    assert "sandbox" not in release_pods(docs)
    check_matrix(docs)


def test_disabled_renders_no_policy():
    docs, _ = render({"networkPolicy": {"enabled": False}})
    assert not by_kind(docs, "NetworkPolicy")


@pytest.mark.parametrize("bad", [
    {"kubeApi": {"ports": []}},
    {"kubeApi": {"ports": [70000]}},
    {"kubeApi": {"cidrs": ["apiserver"]}},
    {"extraEgress": {"rollout": []}},
    {"egress": []},
])
def test_the_schema_refuses_malformed_network_values(bad):
    with pytest.raises(Exception):
        render({"networkPolicy": bad})
