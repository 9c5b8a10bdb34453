"""The Redis users' table (reflow/redis_acl.py) and what is rendered from it: the
docs' table, the chart's copy of the rules, the ACL file, and which process
gets which URL. Redis itself enforcing them: tests/integration/test_redis_acl.py."""

from pathlib import Path

import pytest

from reflow import redis_acl

REPO = Path(__file__).resolve().parents[2]


def test_the_docs_table_is_the_one_in_redis_acl():
    from reflow.docgen import authz as docs

    page = docs.redis_page()
    assert redis_acl.markdown() in page
    for u in redis_acl.USERS:
        assert f"| `{u.name}` | {u.holds} |" in page
        assert all(f"`{c}`" in page for c in u.commands)


def test_the_charts_copy_of_the_rules_is_current():
    assert (REPO / redis_acl.CHART_HELPER).read_text() == redis_acl.chart_helper(), \
        f"{redis_acl.CHART_HELPER} is stale: run `python -m reflow.redis_acl --chart > " \
        f"{redis_acl.CHART_HELPER}`"


def test_each_user_has_its_own_keys_and_no_admin_command():
    replay, scheduler = redis_acl.user("replay"), redis_acl.user("scheduler")
    assert not set(replay.keys) & set(scheduler.keys)
    for u in redis_acl.USERS:
        rule = redis_acl.rule(u)
        assert rule.startswith("resetkeys ") and " resetchannels -@all " in rule
        assert "~*" not in rule.split() and "+@all" not in rule and "&" not in rule
        for command in ("config", "flushall", "flushdb", "keys", "acl", "eval", "debug",
                        "shutdown", "monitor", "script|flush"):
            assert f"+{command}" not in rule.split()
        # Redis 7 refuses to start on an ACL naming a subcommand it lacks: only those
        # every Redis from 6.2 on has.
        assert {c for c in rule.split() if "|" in c} <= {"+script|exists", "+script|load"}
    with pytest.raises(ValueError, match="redis user: 'api' is not one of replay, scheduler"):
        redis_acl.user("api")


def test_a_process_gets_only_its_own_users_url():
    urls = {"replay": "redis://replay:a@h:1/0", "scheduler": "redis://scheduler:b@h:1/0"}
    assert redis_acl.env_for("scheduler", urls) == {
        "REDIS_URL": urls["scheduler"], "REFLOW_REPLAY_REDIS_URL": urls["replay"]}
    assert redis_acl.env_for("replay", urls) == {
        "REDIS_URL": urls["replay"], "REFLOW_REPLAY_REDIS_URL": ""}
    # Blank, not absent: a blank value overrides what the parent's environment holds.
    for service in ("api", "rollout", "trainer", "worker"):
        assert redis_acl.env_for(service, urls) == {"REDIS_URL": "", "REFLOW_REPLAY_REDIS_URL": ""}


def test_urls_acl_files_and_passwords():
    assert redis_acl.user_url("rediss://:old@r.example:6380/2", "replay", "p/w@x") == \
        "rediss://replay:p%2Fw%40x@r.example:6380/2"
    passwords = redis_acl.Passwords.mint()
    assert passwords != redis_acl.Passwords.mint()
    assert passwords.admin not in repr(passwords)
    text = redis_acl.acl_file(passwords)
    assert [line.split()[1] for line in text.splitlines()] == ["default", "replay", "scheduler"]
    for secret in (passwords.admin, *passwords.users.values()):
        assert secret not in text and f"#{redis_acl.password_hash(secret)}" in text
    with pytest.raises(ValueError, match="none for scheduler"):
        redis_acl.Passwords("a", {"replay": "b"})
