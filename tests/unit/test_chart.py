"""The Helm chart: lint, schema, render with several values files, and every
rendered manifest through `kubernetes-validate --strict`; plus the security
and operability properties the chart promises."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

helm = pytest.importorskip("helm_python")

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "reflow"
VALUES_FILES = sorted((CHART / "ci").glob("*-values.yaml"))
K8S_VERSIONS = ("1.25.0", "1.33.0")


def render(values: dict, name: str = "rl", namespace: str = "ml") -> tuple[list[dict], str]:
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(values)
        files = chart.render(values, name=name, namespace=namespace, is_install=True)
    docs = [d for path, text in sorted(files.items()) if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]
    notes = next(text for path, text in files.items() if path.endswith("NOTES.txt"))
    return docs, notes


def by_kind(docs, kind):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_specs(docs):
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            yield d["metadata"]["name"], d["spec"]["template"]["spec"]


def test_the_chart_lints_clean():
    report = helm.lint(str(CHART), strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("values_file", VALUES_FILES, ids=lambda p: p.stem)
def test_every_rendered_manifest_passes_kubernetes_validate_strict(values_file, tmp_path):
    docs, _ = render(yaml.safe_load(values_file.read_text()) or {})
    paths = []
    for n, doc in enumerate(docs):
        if doc["apiVersion"].startswith(("monitoring.coreos.com/", "cert-manager.io/")):
            continue  # a CRD: kubernetes-validate has no schema; checked below
        path = tmp_path / f"{n:02d}-{doc['kind']}.yaml"
        path.write_text(yaml.safe_dump(doc))
        paths.append(str(path))
    assert len(paths) >= 12
    for version in K8S_VERSIONS:
        result = subprocess.run(
            [sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", "-k", version, *paths],
            capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


def test_a_typo_in_values_fails_schema_validation():
    with helm.Chart.load(str(CHART)) as chart:
        for typo, named in (({"worker": {"replcas": 4}}, "replcas"),
                            ({"api": {"auth": {"token": "x"}}}, "token"),
                            ({"serviceMonitor": {"enabled": "yes"}}, "/serviceMonitor/enabled"),
                            ({"worker": {"gpu": {"count": -1}}}, "/worker/gpu/count"),
                            ({"metricsport": 9090}, "metricsport")):
            with pytest.raises(Exception, match=named):
                chart.validate_schema(typo)
            with pytest.raises(Exception):
                chart.render(typo, name="rl", namespace="ml")


def test_pods_run_non_root_without_capabilities_under_runtime_default_seccomp():
    docs, _ = render({})
    specs = dict(pod_specs(docs))
    assert set(specs) == {"rl-reflow-api", "rl-reflow-scheduler", "rl-reflow-replay",
                          "rl-reflow-redis", "rl-reflow-worker", "rl-reflow-sandbox"}
    for name, spec in specs.items():
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] > 0, name
        # The sandbox's bubblewrap creates namespaces, which RuntimeDefault refuses
        # (values.yaml `sandbox.seccompProfile`); every other pod keeps it.
        seccomp = "Unconfined" if name == "rl-reflow-sandbox" else "RuntimeDefault"
        assert pod["seccompProfile"] == {"type": seccomp}, name
        for container in spec["containers"]:
            ctx = container["securityContext"]
            assert ctx["capabilities"] == {"drop": ["ALL"]}, name
            assert ctx["allowPrivilegeEscalation"] is False, name
            assert ctx["readOnlyRootFilesystem"] is True, name
        # Only the scheduler talks to the Kubernetes API.
        assert spec.get("automountServiceAccountToken", True) is (name == "rl-reflow-scheduler"), name


def test_probes_grpc_health_and_a_startup_window_for_model_loading():
    docs, _ = render({})
    specs = dict(pod_specs(docs))
    for name in ("rl-reflow-scheduler", "rl-reflow-replay", "rl-reflow-worker",
                 "rl-reflow-sandbox"):
        c = specs[name]["containers"][0]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert "grpc" in c[probe], (name, probe)
    startup = specs["rl-reflow-worker"]["containers"][0]["startupProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 600
    api = specs["rl-reflow-api"]["containers"][0]
    assert api["readinessProbe"]["httpGet"]["path"] == "/healthz"


def test_workers_request_gpus_under_a_configurable_resource_name():
    docs, _ = render({"worker": {"gpu": {"resourceName": "amd.com/gpu", "count": 2}}})
    worker = by_kind(docs, "StatefulSet")["rl-reflow-worker"]
    resources = worker["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"]["amd.com/gpu"] == 2 and resources["requests"]["amd.com/gpu"] == 2
    docs, _ = render({"worker": {"gpu": {"count": 0}, "imageFlavor": "cpu"}})
    worker = by_kind(docs, "StatefulSet")["rl-reflow-worker"]
    container = worker["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert container["image"].endswith("-cpu") and container["args"][:2] == ["serve", "worker"]


def test_path_roots_and_operator_ceilings_reach_the_scheduler_and_workers_as_env():
    def envs(values):
        specs = dict(pod_specs(render(values)[0]))
        return tuple({e["name"]: e.get("value") for e in specs[name]["containers"][0]["env"]}
                     for name in ("rl-reflow-scheduler", "rl-reflow-worker"))

    scheduler, worker = envs({})
    assert {k: v for k, v in scheduler.items() if k.startswith("REFLOW_MAX_")} == {
        "REFLOW_MAX_ROLLOUT_WORKERS": "0",
        "REFLOW_MAX_BATCH_SIZE": "4096",
        "REFLOW_MAX_RESPONSE_TOKENS": "32768",
        "REFLOW_MAX_INFLIGHT_SAMPLES": "4096",
        "REFLOW_MAX_SAMPLES_PER_STEP": "65536",
        "REFLOW_MAX_KV_CACHE_GB": "256",
        "REFLOW_MAX_NUM_STEPS": "1000000",  # an integer, never 1e+06
        "REFLOW_MAX_ACTIVE_JOBS": "32",
    }
    for env in (scheduler, worker):
        assert env["REFLOW_MODELS_DIR"] == "/models" and env["REFLOW_RUNS_DIR"] == "/runs"
    assert not [k for k in worker if k.startswith("REFLOW_MAX_")]

    scheduler, worker = envs({
        "scheduler": {"limits": {"maxBatchSize": 256, "maxResponseTokens": 2048, "maxInflightSamples": 128,
                                 "maxSamplesPerStep": 512, "maxKvCacheGb": 0.5, "maxNumSteps": 20000000,
                                 "maxActiveJobs": 3}},
        "worker": {"models": {"mountPath": "/mnt/models"}}})
    assert scheduler["REFLOW_MAX_BATCH_SIZE"] == "256"
    assert scheduler["REFLOW_MAX_RESPONSE_TOKENS"] == "2048"
    assert scheduler["REFLOW_MAX_INFLIGHT_SAMPLES"] == "128"
    assert scheduler["REFLOW_MAX_SAMPLES_PER_STEP"] == "512"
    assert scheduler["REFLOW_MAX_KV_CACHE_GB"] == "0.5"
    assert scheduler["REFLOW_MAX_NUM_STEPS"] == "20000000"
    assert scheduler["REFLOW_MAX_ACTIVE_JOBS"] == "3"
    for env in (scheduler, worker):
        assert env["REFLOW_MODELS_DIR"] == "/mnt/models" and env["REFLOW_RUNS_DIR"] == "/runs"

    with helm.Chart.load(str(CHART)) as chart:
        for bad, named in (({"scheduler": {"limits": {"maxJobs": 4}}}, "maxJobs"),
                           ({"scheduler": {"limits": {"maxActiveJobs": 0}}}, "/scheduler/limits/maxActiveJobs"),
                           ({"scheduler": {"limits": {"maxBatchSize": 1.5}}}, "/scheduler/limits/maxBatchSize"),
                           ({"scheduler": {"limits": {"maxKvCacheGb": 0}}}, "/scheduler/limits/maxKvCacheGb")):
            with pytest.raises(Exception, match=named):
                chart.validate_schema(bad)
            with pytest.raises(Exception):
                chart.render(bad, name="rl", namespace="ml")


def test_the_scheduler_role_is_namespaced_and_minimal():
    docs, _ = render({})
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    role = by_kind(docs, "Role")["rl-reflow-scheduler"]
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"])): sorted(r["verbs"]) for r in role["rules"]}
    assert rules == {
        (("",), ("pods",)): ["get", "list", "patch", "watch"],
        (("",), ("pods/log",)): ["get"],
        (("coordination.k8s.io",), ("leases",)): ["create", "get", "update"],
    }
    docs_without_logs, _ = render({"scheduler": {"readPodLogs": False}})
    role = by_kind(docs_without_logs, "Role")["rl-reflow-scheduler"]
    assert [r["resources"] for r in role["rules"]] == [["pods"], ["leases"]]
    binding = by_kind(docs, "RoleBinding")["rl-reflow-scheduler"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rl-reflow-scheduler",
                                    "namespace": "ml"}]


def test_redis_keeps_an_append_only_file_and_services_log_in_as_their_own_users():
    docs, _ = render({})
    redis = by_kind(docs, "StatefulSet")["rl-reflow-redis"]
    command = redis["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert "--appendonly yes --appendfsync everysec " in command
    assert redis["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "8Gi"
    for role in ("replay", "scheduler"):
        pod = by_kind(docs, "Deployment")[f"rl-reflow-{role}"]
        env = {e["name"]: e for e in pod["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
            "name": "rl-reflow-redis", "key": f"{role}-password"}
        assert env["REDIS_URL"]["value"] == f"redis://{role}:$(REDIS_PASSWORD)@rl-reflow-redis:6379/0"

    docs, _ = render({"redis": {"enabled": False, "auth": {"existingSecret": "ext", "passwordKey": "pw"},
                                "external": {"host": "r.example", "port": 6380, "db": 3, "tls": True}}})
    assert "rl-reflow-redis" not in by_kind(docs, "StatefulSet")
    assert not [d for d in docs if d["kind"] == "Secret" and "redis" in d["metadata"]["name"]]
    replay = by_kind(docs, "Deployment")["rl-reflow-replay"]
    env = {e["name"]: e for e in replay["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["REDIS_URL"]["value"] == "rediss://replay:$(REDIS_PASSWORD)@r.example:6380/3"
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "ext", "key": "replay-password"}
    with pytest.raises(Exception, match="redis.external.host"):
        render({"redis": {"enabled": False}})


def _secret_refs(node, found=None) -> set[tuple[str, str]]:
    """(Secret, key) pairs a pod spec reads: env values, envFrom and volumes ("*" for
    every key of a Secret)."""
    found = set() if found is None else found
    if isinstance(node, dict):
        if "secretKeyRef" in node:
            found.add((node["secretKeyRef"]["name"], node["secretKeyRef"]["key"]))
        if "secretRef" in node:
            found.add((node["secretRef"]["name"], "*"))
        secret = node.get("secret")
        if isinstance(secret, dict) and "secretName" in secret:
            keys = [item["key"] for item in secret.get("items", [])] or ["*"]
            found.update((secret["secretName"], key) for key in keys)
        for value in node.values():
            _secret_refs(value, found)
    elif isinstance(node, list):
        for value in node:
            _secret_refs(value, found)
    return found


def test_each_role_gets_only_its_own_redis_credential():
    import base64

    from reflow import redis_acl

    docs, _ = render({})
    secret = by_kind(docs, "Secret")["rl-reflow-redis"]
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    passwords = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert set(passwords) == {"redis-password", "replay-password", "scheduler-password"}
    assert len(set(passwords.values())) == 3 and min(map(len, passwords.values())) >= 32
    # Every Redis user of reflow/redis_acl.py has a key, and Redis alone reads them all
    # (it builds its ACL file from them); each service reads its own user's only, and
    # the API and the workers none.
    expected = {"rl-reflow-redis": set(passwords), "rl-reflow-replay": {"replay-password"},
                "rl-reflow-scheduler": {"scheduler-password"}}
    for name, spec in pod_specs(docs):
        redis_keys = {key for secret_name, key in _secret_refs(spec)
                      if secret_name == "rl-reflow-redis"}
        assert redis_keys == expected.get(name, set()), name
    script = by_kind(docs, "StatefulSet")["rl-reflow-redis"]["spec"]["template"]["spec"][
        "containers"][0]["args"][0]
    for u in redis_acl.USERS:
        assert f'echo "user {u.name} on #$(hash "$REDIS_{u.name.upper()}_PASSWORD") "\'' \
            f"{redis_acl.rule(u)}'" in script
    assert f"user {redis_acl.ADMIN_USER} on" in script and "--requirepass" not in script
    # Upgrades keep the passwords a live Secret already has (helm's lookup), and mint
    # only those of users it lacks.
    template = (CHART / "templates" / "secret-redis.yaml").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace $name' in template


def test_redis_fsyncs_every_write_when_told_and_refuses_other_policies():
    docs, _ = render({"redis": {"appendfsync": "always"}})
    redis = by_kind(docs, "StatefulSet")["rl-reflow-redis"]
    assert "--appendfsync always " in redis["spec"]["template"]["spec"]["containers"][0]["args"][0]
    with helm.Chart.load(str(CHART)) as chart:
        for bad in ("no", "sometimes", ""):
            with pytest.raises(Exception, match="/redis/appendfsync"):
                chart.validate_schema({"redis": {"appendfsync": bad}})
            with pytest.raises(Exception):
                chart.render({"redis": {"appendfsync": bad}}, name="rl", namespace="ml")


def test_opt_in_servicemonitor_and_dashboards_for_the_sidecar():
    docs, notes = render({})
    assert not by_kind(docs, "ServiceMonitor")
    assert "curl" in notes and "/v1/jobs" in notes and "REFLOW_API_TOKEN" in notes

    docs, _ = render(yaml.safe_load((CHART / "ci" / "hardened-values.yaml").read_text()))
    monitor = by_kind(docs, "ServiceMonitor")["rl-reflow"]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    metrics_services = [s for s in by_kind(docs, "Service").values()
                        if s["metadata"]["labels"].get("reflow.io/metrics") == "true"]
    assert {s["metadata"]["name"] for s in metrics_services} == {
        "rl-reflow-api", "rl-reflow-scheduler", "rl-reflow-replay", "rl-reflow-worker",
        "rl-reflow-sandbox"}
    for service in metrics_services:
        assert "metrics" in {p["name"] for p in service["spec"]["ports"]}
    # One policy per role (the matrix itself: test_chart_network.py).
    assert set(by_kind(docs, "NetworkPolicy")) == {
        f"rl-reflow-{role}" for role in ("api", "scheduler", "replay", "worker", "sandbox",
                                         "redis")}
    assert set(by_kind(docs, "PodDisruptionBudget")) == {
        "rl-reflow-api", "rl-reflow-replay", "rl-reflow-worker", "rl-reflow-sandbox",
        "rl-reflow-scheduler"}

    dashboards = [d for d in docs if d["kind"] == "ConfigMap" and "dashboard" in d["metadata"]["name"]]
    assert dashboards and all(d["metadata"]["labels"]["grafana_dashboard"] == "1" for d in dashboards)
    assert dashboards[0]["metadata"]["annotations"] == {"grafana_folder": "ReFlow"}
    board = json.loads(next(iter(dashboards[0]["data"].values())))
    assert len(board["panels"]) >= 9


def test_the_plain_manifests_in_k8s_are_rendered_from_the_chart():
    result = subprocess.run([sys.executable, str(REPO / "k8s" / "render.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    text = (REPO / "k8s" / "reflow.yaml").read_text()
    assert "kind: Secret" not in text  # secrets are referenced, never rendered


def test_the_scheduler_reads_the_workers_run_volume_when_one_is_given():
    """A trainer restarted on a recreated pod resumes from the checkpoints on the
    run volume, which the scheduler must see too (JobController._restart_trainer)."""
    def runs_volume(docs, name):
        spec = dict(pod_specs(docs))[name]
        return next(v for v in spec["volumes"] if v["name"] == "runs")

    docs, _ = render({})
    assert runs_volume(docs, "rl-reflow-scheduler") == {"name": "runs", "emptyDir": {}}
    docs, _ = render({"worker": {"runs": {"existingClaim": "rl-runs"}},
                      "scheduler": {"replaceTimeoutS": 300}})
    for name in ("rl-reflow-scheduler", "rl-reflow-worker"):
        assert runs_volume(docs, name)["persistentVolumeClaim"]["claimName"] == "rl-runs"
    env = {e["name"]: e.get("value") for e in
           dict(pod_specs(docs))["rl-reflow-scheduler"]["containers"][0]["env"]}
    assert env["REFLOW_KUBE_REPLACE_TIMEOUT_S"] == "300"


def _env(container) -> dict:
    return {e["name"]: e for e in container.get("env", [])}


def test_grpc_secrets_reach_each_service_and_each_signing_key_only_its_role():
    import base64

    sys.path.insert(0, str(REPO / "services"))
    from reflow import capabilities

    docs, _ = render({})
    secret = by_kind(docs, "Secret")["rl-reflow-grpc-auth"]
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert len(data["credential"]) >= 32
    for role in ("scheduler", "api"):
        # The certificate holds the public half of that very key: what it signs verifies.
        key = capabilities.load_private_key(data[f"{role}-signing-key"], role)
        public = capabilities.load_public_key(data[f"{role}-public-key"], role)
        token = capabilities.mint(key, role, "/m", "a:1", "", b"")
        assert capabilities.read(token, {role: public}).role == role
    assert data["scheduler-signing-key"] != data["api-signing-key"]
    expected = {  # role -> the Secret's keys its pods mount
        "scheduler": {"credential", "scheduler-signing-key", "scheduler-public-key",
                      "api-public-key"},
        "api": {"credential", "api-signing-key", "scheduler-public-key"},
        "replay": {"credential", "scheduler-public-key"},
        "worker": {"credential", "scheduler-public-key"},
        "sandbox": {"credential", "scheduler-public-key"},
    }
    seen = set()
    for name, spec in pod_specs(docs):
        if name.endswith("-redis"):
            continue
        role = name.removeprefix("rl-reflow-")
        container = spec["containers"][0]
        env = _env(container)
        volume = next(v for v in spec["volumes"] if v["name"] == "grpc-auth")
        keys = {item["key"] for item in volume["secret"]["items"]}
        assert volume["secret"]["secretName"] == "rl-reflow-grpc-auth"
        assert keys == expected[role], name
        assert env["REFLOW_GRPC_CREDENTIAL_FILE"]["value"].endswith("/credential"), name
        signing = {e for e in env if e.endswith("_SIGNING_KEY_FILE")}
        assert signing == ({f"REFLOW_{role.upper()}_SIGNING_KEY_FILE"}
                           if role in ("scheduler", "api") else set()), name
        assert env["REFLOW_SCHEDULER_PUBLIC_KEY_FILE"]["value"].endswith("/scheduler-public-key")
        assert env["REFLOW_TLS"]["value"] == "on"  # per-role certificates: test_chart_tls.py
        seen.add(role)
    assert seen == set(expected)
    # The template keeps the values a live Secret already has (helm's lookup; a plain
    # render has no cluster to look in).
    template = (CHART / "templates" / "secret-grpc.yaml").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace $name' in template


def test_an_existing_grpc_secret_is_referenced_never_rendered_and_upgrades_keep_it():
    values = {"grpcAuth": {"existingSecret": "my-grpc-auth"}}
    docs, _ = render(values)
    assert not [s for s in by_kind(docs, "Secret") if "grpc-auth" in s]
    for name, spec in pod_specs(docs):
        for volume in spec["volumes"]:
            if volume["name"] == "grpc-auth":
                assert volume["secret"]["secretName"] == "my-grpc-auth"
    # An upgrade renders the same objects (the other Secrets are random at each plain
    # render, and kept on a cluster by their own lookup).
    again, _ = render(values)
    kept = lambda rendered: yaml.safe_dump_all([d for d in rendered if d["kind"] != "Secret"])  # noqa: E731
    assert kept(again) == kept(docs)


def test_the_sandbox_serves_the_workers_and_bends_only_seccomp():
    docs, _ = render({})
    specs = dict(pod_specs(docs))
    sandbox = specs["rl-reflow-sandbox"]
    container = sandbox["containers"][0]
    assert container["args"][:2] == ["serve", "sandbox"] and container["image"].endswith("-cpu")
    # Namespaces need no capability and no privilege: the seccomp profile differs, and
    # /proc is unmasked (a fresh one per program), in a user namespace of the pod's own.
    assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                            "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"]},
                                            "procMount": "Unmasked"}
    assert sandbox["hostUsers"] is False
    assert "runtimeClassName" not in sandbox and sandbox["enableServiceLinks"] is False
    service = by_kind(docs, "Service")["rl-reflow-sandbox"]
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"grpc": 50080,
                                                                         "metrics": 9090}
    worker = _env(specs["rl-reflow-worker"]["containers"][0])
    assert worker["REFLOW_SANDBOX_ADDRESS"]["value"] == "rl-reflow-sandbox:50080"
    for name, spec in specs.items():  # the workers' alone
        if name != "rl-reflow-worker":
            assert "REFLOW_SANDBOX_ADDRESS" not in _env(spec["containers"][0]), name

    # Hardened: a profile of the node's and gVisor; its settings as its variables.
    docs, _ = render({"sandbox": {
        "seccompProfile": {"type": "Localhost", "localhostProfile": "profiles/sandbox.json"},
        "runtimeClassName": "gvisor", "replicas": 3,
        "settings": {"REFLOW_SANDBOX_MAX_CONCURRENT": 8}}})
    deployment = by_kind(docs, "Deployment")["rl-reflow-sandbox"]
    spec = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 3 and spec["runtimeClassName"] == "gvisor"
    assert spec["securityContext"]["seccompProfile"] == {
        "type": "Localhost", "localhostProfile": "profiles/sandbox.json"}
    assert spec["securityContext"]["runAsUser"] == 10001
    assert _env(spec["containers"][0])["REFLOW_SANDBOX_MAX_CONCURRENT"]["value"] == "8"
    # The settings the chart takes are the service's (a typo fails the install, not
    # the pod's start).
    schema = json.loads((CHART / "values.schema.json").read_text())
    names = schema["properties"]["sandbox"]["properties"]["settings"]["propertyNames"]["enum"]
    sys.path.insert(0, str(REPO / "services"))
    from reflow.sandbox.service import ENV_PREFIX, SandboxSettings

    assert set(names) == {ENV_PREFIX + f.upper() for f in SandboxSettings.model_fields}
    with helm.Chart.load(str(CHART)) as chart:
        for bad, named in (({"sandbox": {"settings": {"REDIS_URL": "x"}}}, "REDIS_URL"),
                           ({"sandbox": {"settings": {"REFLOW_SANDBOX_MAX_CONCURENT": 8}}},
                            "REFLOW_SANDBOX_MAX_CONCURENT"),
                           ({"sandbox": {"seccompProfile": {"type": "Localhost"}}},
                            "localhostProfile"),
                           ({"sandbox": {"replicas": 0}}, "/sandbox/replicas")):
            with pytest.raises(Exception, match=named):
                chart.validate_schema(bad)

    # Off: no sandbox object, and the workers get no address.
    docs, _ = render({"sandbox": {"enabled": False}})
    assert not [d for d in docs if "sandbox" in d["metadata"]["name"]
                and d["kind"] != "Secret"]
    worker = dict(pod_specs(docs))["rl-reflow-worker"]["containers"][0]
    assert "REFLOW_SANDBOX_ADDRESS" not in _env(worker)


def test_tracker_credentials_reach_the_workers_from_the_operators_secret_only():
    """The job spec never holds a tracker's secret: the trainer, on a worker pod,
    gets the W&B key and an MLflow token from a Secret the operator made, and the
    MLflow server's URI as a plain value."""
    docs, _ = render({"tracking": {"mlflowTrackingUri": "http://mlflow.ml:5000",
                                   "secretName": "reflow-trackers",
                                   "mlflowTokenKey": "mlflow-token"}})
    specs = dict(pod_specs(docs))
    env = _env(specs["rl-reflow-worker"]["containers"][0])
    assert env["REFLOW_MLFLOW_TRACKING_URI"]["value"] == "http://mlflow.ml:5000"
    assert env["WANDB_API_KEY"] == {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {
        "name": "reflow-trackers", "key": "wandb-api-key", "optional": True}}}
    assert env["MLFLOW_TRACKING_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "reflow-trackers", "key": "mlflow-token", "optional": True}
    # The chart makes no such Secret, and no other pod sees the credentials.
    assert "reflow-trackers" not in by_kind(docs, "Secret")
    for name, spec in specs.items():
        if name != "rl-reflow-worker":
            assert not {"WANDB_API_KEY", "MLFLOW_TRACKING_TOKEN"} & set(
                _env(spec["containers"][0])), name
    # By default: no tracker env at all (a job's trackers write its run directory).
    worker = dict(pod_specs(render({})[0]))["rl-reflow-worker"]["containers"][0]
    assert not {"REFLOW_MLFLOW_TRACKING_URI", "WANDB_API_KEY", "MLFLOW_TRACKING_TOKEN"} & set(
        _env(worker))
    # No token key: only the W&B key is referenced.
    docs, _ = render({"tracking": {"secretName": "reflow-trackers"}})
    worker = dict(pod_specs(docs))["rl-reflow-worker"]["containers"][0]
    assert "WANDB_API_KEY" in _env(worker) and "MLFLOW_TRACKING_TOKEN" not in _env(worker)
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(Exception, match="wandbApiKey"):
            chart.validate_schema({"tracking": {"wandbApiKey": "not-here"}})


def test_two_schedulers_by_default_one_acting_behind_the_service_and_updates_never_gap():
    docs, _ = render({})
    deployment = by_kind(docs, "Deployment")["rl-reflow-scheduler"]
    spec = deployment["spec"]
    assert spec["replicas"] == 2
    # A new pod before an old one goes: never no scheduler, nor a standby-less gap.
    assert spec["strategy"] == {"type": "RollingUpdate",
                                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    pod = spec["template"]["spec"]
    term = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == spec["selector"]["matchLabels"]
    # The Service selects the pod the acting scheduler labels; the Deployment never
    # sets that label, so a standby (or a new pod) is no endpoint of it.
    service = by_kind(docs, "Service")["rl-reflow-scheduler"]
    assert service["spec"]["selector"] == {**spec["selector"]["matchLabels"],
                                           "reflow.io/scheduler-leader": "true"}
    assert "reflow.io/scheduler-leader" not in spec["template"]["metadata"]["labels"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    selector = dict(term.split("=") for term in env["REFLOW_SCHEDULER_SELECTOR"].split(","))
    assert selector == spec["selector"]["matchLabels"]
    # Probes read the process's health, which a standby reports SERVING.
    probes = pod["containers"][0]
    assert all("service" not in probes[p]["grpc"]
               for p in ("startupProbe", "readinessProbe", "livenessProbe"))
    pdb = by_kind(docs, "PodDisruptionBudget")["rl-reflow-scheduler"]
    assert pdb["spec"]["maxUnavailable"] == 1
    # One replica: no standby, no affinity, no budget that would block a drain.
    docs, _ = render({"scheduler": {"replicas": 1}})
    assert "affinity" not in by_kind(docs, "Deployment")["rl-reflow-scheduler"]["spec"][
        "template"]["spec"]
    assert "rl-reflow-scheduler" not in by_kind(docs, "PodDisruptionBudget")


def test_the_scheduler_dials_workers_by_the_dns_names_they_answer_to():
    docs, _ = render({"clusterDomain": "corp.example"})
    scheduler = dict(pod_specs(docs))["rl-reflow-scheduler"]["containers"][0]
    template = {e["name"]: e.get("value") for e in scheduler["env"]}["REFLOW_WORKER_ADDRESS"]
    statefulset = by_kind(docs, "StatefulSet")["rl-reflow-worker"]
    # The StatefulSet gives pod rl-reflow-worker-3 hostname rl-reflow-worker-3 and
    # subdomain serviceName; that Service is headless and publishes unready pods,
    # so the name resolves while the scheduler checks the worker itself.
    service = by_kind(docs, "Service")[statefulset["spec"]["serviceName"]]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    address = template.format(hostname="rl-reflow-worker-3", namespace="ml", pod_ip="10.0.0.9",
                              subdomain=statefulset["spec"]["serviceName"], port=50060)
    assert address == "rl-reflow-worker-3.rl-reflow-worker.ml.svc.corp.example:50060"
    worker = statefulset["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in worker["env"]}
    assert env["REFLOW_POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # $(REFLOW_POD_NAME) expands only if that variable comes first.
    order = [e["name"] for e in worker["env"]]
    assert order.index("REFLOW_POD_NAME") < order.index("REFLOW_ADVERTISE_HOSTS")
    advertised = env["REFLOW_ADVERTISE_HOSTS"]["value"].replace("$(REFLOW_POD_NAME)",
                                                                "rl-reflow-worker-3")
    assert address.rsplit(":", 1)[0] in advertised.split(",")
