"""How the Kubernetes backend dials a worker pod (kube_pods.worker_address): by
its DNS name under the StatefulSet's headless Service, at its IP only when the
pod has no such name; and the template an operator may set, checked."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from reflow.scheduler.cluster.kube_pods import worker_address
from reflow.scheduler.cluster.kube_settings import KubeSettings


def _settings(**kw) -> KubeSettings:
    return KubeSettings(namespace="ml", worker_selector="a=b", replay_address="r:1",
                        worker_port=50060, **kw)


def _pod(ip: str, hostname: str | None = "rl-worker-1", subdomain: str | None = "rl-worker"):
    return SimpleNamespace(spec=SimpleNamespace(hostname=hostname, subdomain=subdomain),
                           status=SimpleNamespace(pod_ip=ip))


def test_a_statefulset_pod_keeps_its_address_across_ips():
    s = _settings()
    first, again = worker_address(_pod("10.0.0.5"), s), worker_address(_pod("10.0.7.9"), s)
    assert first == again == "rl-worker-1.rl-worker.ml.svc.cluster.local:50060"


def test_a_pod_without_a_dns_name_is_dialled_at_its_ip():
    assert worker_address(_pod("10.0.0.5", subdomain=None), _settings()) == "10.0.0.5:50060"
    ip_mode = _settings(worker_address="{pod_ip}:{port}")
    assert worker_address(_pod("10.0.0.5"), ip_mode) == "10.0.0.5:50060"
    # A DNS server named as the target's authority travels with the address.
    custom = _settings(worker_address="dns://10.96.0.10:53/{hostname}.{subdomain}:{port}")
    assert worker_address(_pod("10.0.0.5"), custom) == "dns://10.96.0.10:53/rl-worker-1.rl-worker:50060"


@pytest.mark.parametrize("template", ["{hostname}.{subdomain}", "{pod_name}:{port}",
                                      "{hostname}:{port", "{0}:{port}"])
def test_a_bad_template_is_refused_naming_the_variable(template):
    with pytest.raises(ValidationError, match="REFLOW_WORKER_ADDRESS"):
        _settings(worker_address=template)


def test_an_rpc_may_name_a_worker_with_its_dns_server_and_nothing_more():
    from reflow.core.paths import check_address

    assert check_address("dns://10.96.0.10:53/rl-worker-1.rl-worker:50060", "f")
    for bad in ("dns:///rl-worker-1:50060", "http://rl-worker-1:50060",
                "dns://10.96.0.10:53/rl-worker-1:50060/x", "rl-worker-1:99999"):
        with pytest.raises(ValueError, match="rollout_addresses"):
            check_address(bad, "rollout_addresses")
