"""One authorization table for every RPC: the role whose signed capability each
control call needs, and the roles whose job pass each other call takes
(reflow.rpcauth enforces it; the docs' "Who may call what" page is rendered from
it when the docs are built, by reflow.docgen, and `python -m reflow.authz` prints
the same table). A method in neither table fails its server's start: a new RPC
is never open by default.
"""

from __future__ import annotations

from collections.abc import Iterable

# The control calls: the role whose capability each needs, and why. A call naming
# no job (a status poll, a listing) is the scheduler's too (NO_JOB_ROLE).
CONTROL_TABLE: dict[str, dict[str, tuple[str, str]]] = {
    "reflow.v1.Scheduler": {
        "*": ("api", "job administration: the API's calls on a user's behalf"),
    },
    "reflow.v1.Rollout": {
        "StartJob": ("scheduler", "names the replay buffer and trainer the engine works for"),
        "StopJob": ("scheduler", "ends a job on the worker"),
        "SetSyncPlace": ("scheduler", "moves the engine within the trainer's weight-sync group"),
    },
    "reflow.v1.Trainer": {
        "StartJob": ("scheduler", "names the replay buffer, rollout workers and peers the "
                                  "trainer trusts"),
        "StopJob": ("scheduler", "ends a job on the trainer"),
        "Reconfigure": ("scheduler", "names the trainer group's members and the engines it "
                                     "publishes to"),
    },
    "reflow.v1.Worker": {
        "SetRole": ("scheduler", "flips a worker between trainer and rollout"),
    },
    "reflow.v1.ReplayBuffer": {
        "EndJob": ("scheduler", "ends a job on the buffer: its passes are no longer taken "
                                "there (its samples stay, for a resume)"),
    },
}
NO_JOB_ROLE = "scheduler"

# Every other call names a job and carries the caller's job pass: the roles whose
# pass each method takes (the scheduler's own calls carry its capability instead).
JOB_CALLERS: dict[str, dict[str, tuple[str, ...]]] = {
    "reflow.v1.ReplayBuffer": {
        "Configure": ("trainer",), "Put": ("rollout",), "Sample": ("trainer",),
        "Release": ("trainer",), "RenewLease": ("trainer",), "ReturnLease": ("trainer",),
        # The dispatcher's (the scheduler's): its bounds are the scheduler's to set.
        "AcquireDispatch": (),
        "PublishVersion": ("trainer",), "GetStats": ("trainer", "rollout"),
    },
    "reflow.v1.Rollout": {
        "InitWeightSync": ("trainer",), "UpdateWeights": ("trainer",),
        # The trainer reads its engines' versions and states (trainer/publish.py).
        "Evaluate": ("trainer",), "GetStats": ("trainer",), "ScoreTokens": ("trainer",),
        "SubmitGroup": (),
        "WaitSamples": (),
    },
    # Trainer replicas poll their leader, and the leader its replicas: it asks them
    # to join its groups and to leave one it gave up (trainer/membership.py).
    "reflow.v1.Trainer": {"GetStatus": ("trainer",), "JoinGroup": ("trainer",),
                          "LeaveGroup": ("trainer",)},
    "reflow.v1.Worker": {"GetRole": ()},
    # Rollout workers run the environments that execute model-written code. The
    # sandbox keeps no book of jobs: any job whose rollout pass verifies is served
    # (rpcauth.EVERY_JOB). Its counters name no job: the scheduler's.
    "reflow.v1.Sandbox": {"Execute": ("rollout",), "GetStats": ()},
}
# The scheduler's calls that put a job on a server (and its pass in the server's
# book), and those that take it off: after them the job's passes get NOT_FOUND there.
# The replay buffer's starting call is the scheduler's Configure, which it makes
# when it places (or resumes) the job, before the trainer starts: the one call
# that grants a job the buffer saw end (EndJob). Any other of the scheduler's
# calls naming a job grants it only if it never ended there (core.grants.
# RedisGrants), so a read of a finished job's stats does not open it again.
GRANTING = frozenset({"/reflow.v1.Rollout/StartJob", "/reflow.v1.Trainer/StartJob",
                      "/reflow.v1.Worker/SetRole", "/reflow.v1.ReplayBuffer/Configure"})
REVOKING = frozenset({"/reflow.v1.Rollout/StopJob", "/reflow.v1.Trainer/StopJob",
                      "/reflow.v1.ReplayBuffer/EndJob"})
# The services that keep no grants (their servers take rpcauth.EVERY_JOB): a pass
# that verifies is enough, for any job.
GRANTLESS = frozenset({"reflow.v1.Sandbox"})
# The service whose calls a pass of each role is handed with (the callee's role).
_CALLEE_ROLE = {"reflow.v1.Rollout": "rollout", "reflow.v1.Trainer": "trainer"}


def control_methods(service_names: Iterable[str]) -> dict[str, str]:
    """Full method name ("/pkg.Service/Method") -> the role it needs, for the
    CONTROL_TABLE entries of these services; "*" stands for every method."""
    from google.protobuf import descriptor_pool

    import reflow.v1  # noqa: F401 - registers the descriptors
    from reflow.v1 import (replay_pb2, rollout_pb2, sandbox_pb2,  # noqa: F401
                           scheduler_pb2, trainer_pb2, worker_pb2)

    pool = descriptor_pool.Default()
    names: dict[str, str] = {}
    for service in service_names:
        declared = {m.name for m in pool.FindServiceByName(service).methods}
        table = CONTROL_TABLE.get(service, {})
        methods = {m: role for m, (role, _) in table.items()}
        if "*" in methods:
            methods = {m: methods["*"] for m in declared}
        if set(methods) - declared:  # a misspelt name would protect nothing
            raise ValueError(f"CONTROL_TABLE names {sorted(set(methods) - declared)}, which "
                             f"{service} does not declare")
        names.update({f"/{service}/{m}": role for m, role in methods.items()})
    return names


def job_callers(service_names: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Full method name -> the roles whose job pass it takes, for the JOB_CALLERS
    entries of these services. Every method must be in CONTROL_TABLE or here: a
    new RPC without an entry fails the server's start, not open."""
    from google.protobuf import descriptor_pool

    control = control_methods(service_names)
    pool = descriptor_pool.Default()
    out: dict[str, tuple[str, ...]] = {}
    for service in service_names:
        table = JOB_CALLERS.get(service, {})
        for method in pool.FindServiceByName(service).methods:
            name = f"/{service}/{method.name}"
            if name in control:
                continue
            if method.name not in table:
                raise ValueError(f"{name} is in neither CONTROL_TABLE nor JOB_CALLERS")
            out[name] = table[method.name]
    return out


SERVICES = ("reflow.v1.Scheduler", "reflow.v1.Trainer", "reflow.v1.Rollout", "reflow.v1.Worker",
            "reflow.v1.ReplayBuffer", "reflow.v1.Sandbox")


def authorization_rows() -> list[tuple[str, str, str]]:
    """(method, who may call it, why) for every RPC the protos declare, as the
    Authorizer decides: the table the docs render ("Who may call what")."""
    from google.protobuf import descriptor_pool

    control = control_methods(SERVICES)
    pool = descriptor_pool.Default()
    rows = []
    for service in SERVICES:
        table = CONTROL_TABLE.get(service, {})
        for method in pool.FindServiceByName(service).methods:
            name = f"/{service}/{method.name}"
            job = any(f.name == "job_id" for f in method.input_type.fields)
            if name in control:
                role = control[name]
                why = (table.get(method.name) or table["*"])[1]
                rows.append((f"{service.split('.')[-1]}.{method.name}",
                             f"the {role} (capability)", why))
            else:
                roles = JOB_CALLERS[service][method.name]
                who = "".join(f"the {r} (its job pass), " for r in roles) + \
                    f"the {NO_JOB_ROLE} (capability)"
                why = "names a job: the pass's job and role must match" if job \
                    else "names no job"
                if name in GRANTING:
                    why += "; the scheduler's call (re)starts the job here"
                if job and service in GRANTLESS:
                    why += "; any job (this service keeps no grants)"
                rows.append((f"{service.split('.')[-1]}.{method.name}", who, why))
    return rows


def authorization_markdown() -> str:
    lines = ["| RPC | who may call it | why |", "|---|---|---|"]
    lines += [f"| `{m}` | {who} | {why} |" for m, who, why in authorization_rows()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # the docs' "Who may call what" table
    print(authorization_markdown(), end="")
