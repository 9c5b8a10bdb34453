"""The two authorization reference pages: who may call each RPC (rendered by
reflow.authz from its tables and the protos) and the Redis users (rendered by
reflow.redis_acl from USERS). The tables are theirs; this adds the page around."""

from __future__ import annotations

from reflow.docgen.text import generated_note


def rpc_page() -> str:
    from reflow.authz import authorization_markdown

    return "\n".join([
        "# Who may call what (gRPC)", "",
        generated_note("`reflow/authz.py` (its tables, and the services the protos declare)"),
        "",
        "Every RPC, and what its server checks before it reads the request. A control call "
        "needs a capability signed by the named role for that one method and body; every "
        "other call names a job and carries a job pass of one of the named roles. A method "
        "missing from both tables stops its server from starting, so a new RPC is never "
        "open by default. `python -m reflow.authz` prints the same table.", "",
        authorization_markdown(),
    ])


def redis_page() -> str:
    from reflow.redis_acl import markdown

    return "\n".join([
        "# Redis users", "",
        generated_note("`USERS` in `reflow/redis_acl.py`"), "",
        "One Redis user per role that keeps state in Redis, each allowed only its own keys "
        "and the commands its store sends; rollout, trainer and API processes get no Redis "
        "credential at all. `python -m reflow.redis_acl` prints the same table, "
        "`--rules` the `ACL SETUSER` commands for a Redis run elsewhere.", "",
        markdown(),
    ])
