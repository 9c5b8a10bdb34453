"""The docs' reference pages, rendered from the code itself: the job spec from its
pydantic models, the CLI from its argparse parser, the REST API from its OpenAPI
schema, the metrics from the Prometheus registries, and the RPC and Redis
authorization tables from their one source each. Each page is one function that
returns Markdown; the docs build (docs/hooks/reference.py) calls them, so nothing
rendered here is committed. It owns the rendering only, never what it renders.
"""

from __future__ import annotations

from collections.abc import Callable


def pages() -> dict[str, Callable[[], str]]:
    """Site path of each generated page -> the function that renders it. Imports stay
    inside, so that listing the pages costs nothing."""
    from reflow.docgen import authz, cli, jobspec, metrics, rest

    return {
        "reference/jobspec.md": jobspec.page,
        "reference/cli.md": cli.page,
        "reference/rest.md": rest.page,
        "reference/metrics.md": metrics.page,
        "reference/rpc-authorization.md": authz.rpc_page,
        "reference/redis-users.md": authz.redis_page,
    }
