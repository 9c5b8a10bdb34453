"""The chart's gRPC TLS: on by default, a certificate per role from the release's
own CA naming the role as the services check it (reflow.tlscerts), each role
mounting only its own key; cert-manager, Secrets of one's own, or off, when
the values say so."""

import base64

import pytest
import yaml

pytest.importorskip("helm_python")

from reflow import tlscerts  # noqa: E402
from tests.unit.test_chart import CHART, REPO, by_kind, pod_specs, render  # noqa: E402

# Pod (Deployment or StatefulSet) -> the role whose certificate it holds.
POD_ROLES = {"rl-reflow-api": "api", "rl-reflow-scheduler": "scheduler",
             "rl-reflow-replay": "replay", "rl-reflow-worker": "worker",
             "rl-reflow-sandbox": "sandbox"}
MOUNT = "/var/run/secrets/reflow/tls"


def _env(container) -> dict:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def _tls_volumes(spec) -> list[dict]:
    return [v for v in spec["volumes"] if v["name"] == "grpc-tls"]


def _check_each_role_mounts_its_own(docs, secret_of) -> None:
    """Every service pod: TLS on, its own role's Secret mounted (and no other
    TLS Secret), the files where the env names them, probes on the health port."""
    pods = dict(pod_specs(docs))
    assert set(POD_ROLES) <= set(pods)
    mounted = {}
    for name, spec in pods.items():
        if name not in POD_ROLES:
            assert not _tls_volumes(spec), name  # Redis speaks no gRPC
            continue
        container = spec["containers"][0]
        env = _env(container)
        assert env["REFLOW_TLS"] == "on", name
        assert env["REFLOW_TLS_CERT_FILE"] == f"{MOUNT}/tls.crt"
        assert env["REFLOW_TLS_KEY_FILE"] == f"{MOUNT}/tls.key"
        assert env["REFLOW_TLS_CA_FILE"] == f"{MOUNT}/ca.crt"
        assert "REFLOW_TLS_SERVER_NAME" not in env, name  # per-role names
        [volume] = _tls_volumes(spec)
        assert volume["secret"]["secretName"] == secret_of(POD_ROLES[name]), name
        assert {i["key"] for i in volume["secret"]["items"]} == {"tls.crt", "tls.key", "ca.crt"}
        assert {"name": "grpc-tls", "mountPath": MOUNT, "readOnly": True} in \
            container["volumeMounts"]
        mounted[name] = volume["secret"]["secretName"]
        if "grpc" in container.get("readinessProbe", {}):
            assert container["readinessProbe"]["grpc"]["port"] == 50070
            assert env["REFLOW_GRPC_HEALTH_PORT"] == "50070"
    assert len(set(mounted.values())) == len(mounted), mounted  # no two roles share a key


def test_tls_is_on_by_default_with_a_certificate_per_role_from_one_ca():
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    docs, _ = render({})
    _check_each_role_mounts_its_own(docs, lambda role: f"rl-reflow-grpc-tls-{role}")
    secrets = {n: d for n, d in by_kind(docs, "Secret").items() if "-grpc-tls-" in n}
    assert set(secrets) == {f"rl-reflow-grpc-tls-{role}" for role in POD_ROLES.values()}
    cas = set()
    for name, secret in secrets.items():
        role = name.removeprefix("rl-reflow-grpc-tls-")
        assert secret["type"] == "kubernetes.io/tls"
        assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
        ca = x509.load_pem_x509_certificate(data["ca.crt"])
        cert = x509.load_pem_x509_certificate(data["tls.crt"])
        cert.verify_directly_issued_by(ca)
        cas.add(data["ca.crt"])
        # The names the services check (reflow.tlscerts), for both ends of a handshake.
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert names.get_values_for_type(x509.DNSName) == tlscerts.role_names(role), role
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert {u.dotted_string for u in usages} == {"1.3.6.1.5.5.7.3.1", "1.3.6.1.5.5.7.3.2"}
        key = serialization.load_pem_private_key(data["tls.key"], None)
        assert key.public_key().public_numbers() == cert.public_key().public_numbers()
    assert len(cas) == 1  # one CA for the release
    # Upgrades keep them (helm's lookup; a plain render has no cluster to look in).
    template = (CHART / "templates" / "secret-tls.yaml").read_text()
    assert 'lookup "v1" "Secret" $root.Release.Namespace' in template


def test_the_charts_certificates_pass_the_services_own_handshake(tmp_path, monkeypatch):
    """The worker's certificate, as the chart minted it, is accepted by a client that
    dials a rollout and refused by one that dials the scheduler."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from reflow import rpc

    docs, _ = render({})
    for role in ("worker", "scheduler"):
        data = by_kind(docs, "Secret")[f"rl-reflow-grpc-tls-{role}"]["data"]
        for key, suffix in (("tls.crt", "crt"), ("tls.key", "key"), ("ca.crt", "ca")):
            (tmp_path / f"{role}.{suffix}").write_bytes(base64.b64decode(data[key]))

    def use(role: str) -> None:
        monkeypatch.setenv(tlscerts.TLS_ENV, "on")
        monkeypatch.setenv(tlscerts.TLS_CERT_ENV, str(tmp_path / f"{role}.crt"))
        monkeypatch.setenv(tlscerts.TLS_KEY_ENV, str(tmp_path / f"{role}.key"))
        monkeypatch.setenv(tlscerts.TLS_CA_ENV, str(tmp_path / f"{role}.ca"))

    for env in (tlscerts.TLS_SERVER_NAME_ENV, tlscerts.TLS_DIR_ENV, rpc.HEALTH_PORT_ENV):
        monkeypatch.delenv(env, raising=False)
    use("worker")
    server, port = rpc.make_server("reflow.v1.Worker", lambda s: None, "127.0.0.1:0")
    use("scheduler")
    outcome = {}
    try:
        for meant in ("rollout", "trainer", "worker", "scheduler", "replay"):
            with rpc.channel(f"127.0.0.1:{port}", meant) as ch:
                try:
                    health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                         timeout=5)
                    outcome[meant] = "ok"
                except grpc.RpcError as err:
                    outcome[meant] = err.code().name
    finally:
        server.stop(0)
    assert outcome == {"rollout": "ok", "trainer": "ok", "worker": "ok",
                       "scheduler": "UNAVAILABLE", "replay": "UNAVAILABLE"}


def test_cert_manager_issues_each_roles_certificate_from_one_ca():
    docs, _ = render({"tls": {"certManager": {"enabled": True}}})
    _check_each_role_mounts_its_own(docs, lambda role: f"rl-reflow-grpc-tls-{role}")
    assert not [n for n in by_kind(docs, "Secret") if "-grpc-tls" in n]
    certificates = by_kind(docs, "Certificate")
    # No issuer named: the release's own self-signed CA, and an Issuer from it.
    ca = certificates.pop("rl-reflow-grpc-ca")
    assert ca["spec"]["isCA"] is True
    assert ca["spec"]["issuerRef"] == {"name": "rl-reflow-grpc-selfsigned", "kind": "Issuer"}
    issuers = by_kind(docs, "Issuer")
    assert issuers["rl-reflow-grpc-selfsigned"]["spec"] == {"selfSigned": {}}
    assert issuers["rl-reflow-grpc-ca"]["spec"] == {"ca": {"secretName": "rl-reflow-grpc-ca"}}
    assert set(certificates) == {f"rl-reflow-grpc-tls-{r}" for r in POD_ROLES.values()}
    for name, certificate in certificates.items():
        role = name.removeprefix("rl-reflow-grpc-tls-")
        spec = certificate["spec"]
        assert spec["secretName"] == name
        assert spec["dnsNames"] == tlscerts.role_names(role)
        assert {"server auth", "client auth"} <= set(spec["usages"])
        assert spec["issuerRef"] == {"name": "rl-reflow-grpc-ca", "kind": "Issuer"}
    # An issuer of the operator's: every role's certificate from it, no CA of the chart's.
    docs, _ = render(yaml.safe_load((CHART / "ci" / "mtls-values.yaml").read_text()))
    certificates = by_kind(docs, "Certificate")
    assert set(certificates) == {f"rl-reflow-grpc-tls-{r}" for r in POD_ROLES.values()}
    for certificate in certificates.values():
        assert certificate["spec"]["issuerRef"] == {"name": "cluster-ca", "kind": "ClusterIssuer"}
    assert not by_kind(docs, "Issuer")


def test_secrets_of_ones_own_are_mounted_per_role_and_never_rendered():
    docs, _ = render({"tls": {"existingSecretPrefix": "my-tls"}})
    _check_each_role_mounts_its_own(docs, lambda role: f"my-tls-{role}")
    assert not [n for n in by_kind(docs, "Secret") if "tls" in n]
    assert not by_kind(docs, "Certificate")
    # The plain manifests reference theirs (k8s/README.md makes them).
    values = yaml.safe_load((REPO / "k8s" / "values.yaml").read_text())
    assert values["tls"]["existingSecretPrefix"] == "reflow-grpc-tls"


def test_one_shared_certificate_or_none_only_when_asked():
    docs, _ = render({"tls": {"secretName": "shared-tls", "serverName": "reflow"}})
    for name, spec in pod_specs(docs):
        if name in POD_ROLES:
            assert _tls_volumes(spec)[0]["secret"]["secretName"] == "shared-tls"
            assert _env(spec["containers"][0])["REFLOW_TLS_SERVER_NAME"] == "reflow"
    assert not [n for n in by_kind(docs, "Secret") if "tls" in n]
    # Off: plaintext said out loud (REFLOW_TLS=off), probes on the service port.
    docs, _ = render({"tls": {"enabled": False}})
    for name, spec in pod_specs(docs):
        if name in POD_ROLES:
            container = spec["containers"][0]
            assert _env(container)["REFLOW_TLS"] == "off" and not _tls_volumes(spec)
            probe = container.get("readinessProbe", {})
            assert "grpc" not in probe or probe["grpc"]["port"] != 50070, name
    assert not [n for n in by_kind(docs, "Secret") if "tls" in n]


def test_the_chart_names_the_roles_as_the_services_do():
    """One table in the code (reflow.tlscerts.SERVES), one in the chart (_helpers.tpl):
    the pods the chart runs are the roles the code knows, with the same names."""
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    table = helpers.split('define "reflow.tlsRoles" -}}\n', 1)[1].split("{{- end -}}", 1)[0]
    assert yaml.safe_load(table) == {role: tlscerts.role_names(role) for role in POD_ROLES.values()}
