"""Fixtures shared by module: test_kube_cluster.py's cluster (module-scoped: one
API server and four worker processes for the whole module), its pods and a
scheduler over them. They live in kube_cluster.py beside the helpers they use."""

from tests.integration.kube_cluster import cluster, pods, scheduler  # noqa: F401
