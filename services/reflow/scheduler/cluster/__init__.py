"""Cluster backends: where a job's services run and how they come back. Local
processes (`local`) or the worker pods of a Kubernetes release (`kube*`), both
behind the `backend.Backend` protocol, plus the scheduler's leader lease."""
