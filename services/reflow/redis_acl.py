"""Redis users: one ACL user per role that keeps state in Redis, each allowed
only its own keys and the commands its store sends.

`USERS` is the one table. Everything else is rendered from it: the ACL file the
embedded Redis of `reflow run` starts with (replay/embedded.py), the chart's
`_redis_acl.tpl` that the Redis StatefulSet builds its ACL file from
(`python -m reflow.redis_acl --chart`; a test keeps that copy current), and the
docs' "Redis users" page (rendered when the docs are built, by reflow.docgen;
`python -m reflow.redis_acl` prints the same table). Tests also run every store
operation as its user against a real Redis.

- `replay`: the buffer's per-job keys (replay/store.py) and the job grants
  (core/grants.py). The buffer serves every rollout and trainer process; it cannot
  read or rewrite a job record, the dispatch ledger, or anything else.
- `scheduler`: the job store (scheduler/jobcontrol/jobs.py) and the dispatch ledger
  (scheduler/generation/inflight.py, which sits in the job's hash slot beside the buffer's
  keys but under names of its own). It reads no sample: it learns a buffer's
  counters through the buffer's own `GetStats`.
- `default`: the administrator (every key and command), with a password that no
  service holds; Redis's own probes and an operator's `redis-cli` use it.

No user may run CONFIG, FLUSHALL, KEYS, ACL, DEBUG, SHUTDOWN, MONITOR or any
other command outside its list, nor publish or subscribe. Passwords are stored
as SHA-256 hashes in the ACL file (Redis's `#<hash>` form).

Not here: how a store connects (redisconn.py), the key layouts themselves (the
stores' docstrings), and which process receives which URL (launcher.py,
scheduler/cluster/local.py, the chart's `reflow.redisEnv`).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit


@dataclass(frozen=True)
class RedisUser:
    name: str
    # What the role keeps in Redis, for the docs.
    holds: str
    # Glob patterns (ACL `~pattern`) of the keys it reads and writes; nothing else.
    keys: tuple[str, ...]
    # The data commands its store sends, from Python or from its Lua scripts
    # (Redis checks each command a script runs against the caller's user).
    commands: tuple[str, ...]


# The buffer's per-job keys, under `reflow:{<job>}:` (replay/store.py's layout).
_BUFFER_KEYS = ("samples", "sample_meta", "members", "meta", "seq", "unused", "replay",
                "by_version", "leases", "lease:*", "stats", "version", "config")

USERS: tuple[RedisUser, ...] = (
    RedisUser(
        name="replay",
        holds="the replay buffer: samples, pools, leases, counters, versions and config "
              "per job, and the jobs it was granted",
        keys=(*(f"reflow:{{*}}:{name}" for name in _BUFFER_KEYS), "reflow:job_grants"),
        commands=("del", "exists", "get", "set", "hdel", "hexists", "hget", "hgetall",
                  "hincrby", "hmget", "hset", "hsetnx", "zadd", "zcard", "zrandmember",
                  "zrange", "zrangebyscore", "zrem", "zscore"),
    ),
    RedisUser(
        name="scheduler",
        holds="the scheduler: job records, their order and step metrics, and each "
              "job's dispatch ledger (stream position, groups in flight)",
        keys=("reflow:jobs", "reflow:jobs:*", "reflow:{*}:dispatch", "reflow:{*}:inflight"),
        commands=("multi", "exec", "hdel", "hexists", "hget", "hgetall", "hincrby", "hmget",
                  "hset", "hsetnx", "incr", "zadd", "zrangebyscore", "zremrangebyrank",
                  "zremrangebyscore", "zrevrangebyscore"),
    ),
)
USER_NAMES = tuple(u.name for u in USERS)

# What every user's client sends besides its store's commands, and why. Not CLIENT:
# redis-py's optional calls on connect (SETINFO, MAINT_NOTIFICATIONS) are refused and
# it goes on without them (the ACL log counts them under `client`); allowing them by
# name would not do either, since Redis 7 refuses to load an ACL naming a subcommand
# it does not have (SETINFO is 7.2's, MAINT_NOTIFICATIONS 8's).
CLIENT_COMMANDS: dict[str, str] = {
    "evalsha": "runs the stores' Lua scripts (each transition is one atomic script)",
    "script|exists": "a pipeline checks that its scripts are loaded",
    "script|load": "loads a script the server does not hold yet (after a Redis restart)",
    "select": "a URL naming a database other than 0 selects it on connect",
}

ADMIN_USER = "default"
ADMIN_RULE = "~* &* +@all"

# A process's own user's URL, and (the scheduler under `reflow run`, which starts
# replay buffers) the buffer's.
REDIS_URL_ENV = "REDIS_URL"
REPLAY_URL_ENV = "REFLOW_REPLAY_REDIS_URL"


def user(name: str) -> RedisUser:
    for u in USERS:
        if u.name == name:
            return u
    raise ValueError(f"redis user: {name!r} is not one of {', '.join(USER_NAMES)}")


def rule(u: RedisUser) -> str:
    """The user's ACL rule, less `on` and its password: its keys, no channel, and
    no command outside its own and CLIENT_COMMANDS."""
    commands = sorted({*u.commands, *CLIENT_COMMANDS})
    return " ".join(["resetkeys", *(f"~{p}" for p in u.keys), "resetchannels", "-@all",
                     *(f"+{c}" for c in commands)])


def password_hash(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()


@dataclass(frozen=True)
class Passwords:
    """The administrator's password and each user's."""

    admin: str
    users: dict[str, str] = field(default_factory=dict)

    @classmethod
    def mint(cls) -> Passwords:
        """Fresh random passwords (URL-safe, 256 bits each)."""
        return cls(secrets.token_urlsafe(32), {n: secrets.token_urlsafe(32) for n in USER_NAMES})

    def __post_init__(self) -> None:
        missing = sorted(set(USER_NAMES) - set(self.users))
        if missing:
            raise ValueError(f"redis passwords: none for {', '.join(missing)}")

    def __repr__(self) -> str:  # never a password in a log line or a traceback
        return f"Passwords(users={sorted(self.users)})"


def acl_file(passwords: Passwords) -> str:
    """An ACL file (redis-server --aclfile) with the administrator and every user,
    their passwords as hashes."""
    lines = [f"user {ADMIN_USER} on #{password_hash(passwords.admin)} {ADMIN_RULE}"]
    lines += [f"user {u.name} on #{password_hash(passwords.users[u.name])} {rule(u)}"
              for u in USERS]
    return "\n".join(lines) + "\n"


def write_acl_file(path: Path, passwords: Passwords) -> Path:
    """Write `acl_file` to `path`, readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # a file left by an earlier run keeps its mode otherwise
        f.write(acl_file(passwords))
    return path


def user_url(url: str, name: str, password: str) -> str:
    """`url` (redis:// or rediss://) logging in as `name` with `password`."""
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(
        netloc=f"{quote(name, safe='')}:{quote(password, safe='')}@{host}"))


def env_for(service: str, urls: dict[str, str]) -> dict[str, str]:
    """The Redis variables of a process that runs `service`, given each user's URL:
    REDIS_URL is its own user's, blank for a service that keeps nothing in Redis; the
    scheduler also gets the buffer's, to start buffers with (`reflow run`). A blank
    value overrides what the process would inherit from its parent."""
    env = {REDIS_URL_ENV: urls.get(service, ""), REPLAY_URL_ENV: ""}
    if service == "scheduler":
        env[REPLAY_URL_ENV] = urls.get("replay", "")
    return env


def markdown() -> str:
    """The "Redis users" table of the docs' reference."""
    lines = ["| user | holds | keys | commands |", "|---|---|---|---|"]
    for u in USERS:
        keys = ", ".join(f"`{k}`" for k in u.keys)
        commands = " ".join(f"`{c}`" for c in sorted(u.commands))
        lines.append(f"| `{u.name}` | {u.holds} | {keys} | {commands} |")
    lines.append(f"| `{ADMIN_USER}` | the administrator: no service holds its password | "
                 "every key | every command |")
    shared = "; ".join(f"`{c}`: {why}" for c, why in CLIENT_COMMANDS.items())
    return "\n".join(lines) + f"\n\nEvery user may also send {shared}.\n"


CHART_HELPER = Path("charts/reflow/templates/_redis_acl.tpl")


def chart_helper() -> str:
    """The chart's `_redis_acl.tpl`: each user's rule, for redis.yaml's ACL file and
    for the Secret's keys (one password per user)."""
    rules = []
    for u in USERS:
        text = rule(u)
        if "'" in text or "{{" in text:  # it goes in as a YAML and template literal
            raise ValueError(f"redis_acl.USERS[{u.name}]: a rule with ' or {{{{ cannot be "
                             f"rendered into the chart: {text}")
        rules.append(f"{u.name}: '{text}'")
    return "\n".join([
        "{{- /* Generated from services/reflow/redis_acl.py by `python -m reflow.redis_acl "
        "--chart`; a test keeps it current. Do not edit. */}}",
        "{{- /* Each Redis user's ACL rule, less `on` and its password (redis.yaml adds "
        "both). */}}",
        '{{- define "reflow.redisAclRules" -}}',
        *rules,
        "{{- end -}}",
        f'{{{{- define "reflow.redisAdminUser" -}}}}{ADMIN_USER}{{{{- end -}}}}',
        f'{{{{- define "reflow.redisAdminRule" -}}}}{ADMIN_RULE}{{{{- end -}}}}',
    ]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The Redis users of each ReFlow role.")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--chart", action="store_true",
                      help=f"print {CHART_HELPER} (the chart's copy of the rules)")
    what.add_argument("--rules", action="store_true",
                      help="print `ACL SETUSER` commands for a Redis run elsewhere (add "
                           "each user's password as `>password` after `on`)")
    args = parser.parse_args(argv)
    if args.chart:
        print(chart_helper(), end="")
    elif args.rules:
        for u in USERS:
            print(f"ACL SETUSER {u.name} reset on {rule(u)}")
    else:
        print(markdown(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
