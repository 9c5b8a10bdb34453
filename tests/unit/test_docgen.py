"""The generated reference pages (reflow.docgen) and the docs hook that adds them:
each page follows the code it is rendered from, and lists what it must."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from pydantic import BaseModel, Field, create_model

from reflow.core.config import ReplayConfig
from reflow.docgen import authz, cli, jobspec, metrics, pages, rest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "services" / "reflow"


def _row(page: str, field: str) -> str:
    return next(line for line in page.splitlines() if line.startswith(f"| `{field}` |"))


def test_the_jobspec_page_follows_a_fields_bound():
    before = _row(jobspec.page(), "replay.replay_cap")
    assert "≥ 0.0, < 1.0" in before and "σ" in before
    # The same section with the cap's bound moved, as a change to config.py would.
    tighter = create_model("ReplayConfig", __base__=ReplayConfig,
                           replay_cap=(float, Field(default=0.25, ge=0.1, le=0.75,
                                                    description="σ, bounded tighter.")))

    class Spec(BaseModel):
        replay: tighter = Field(default_factory=tighter)

    after = _row(jobspec.page(Spec), "replay.replay_cap")
    assert "≥ 0.1, ≤ 0.75" in after and "`0.25`" in after
    assert "< 1.0" not in after and "≥ 0.0" not in after
    # The rest of the section is still walked from the base model.
    assert "| `replay.replay_weight` |" in jobspec.page(Spec)


def test_the_jobspec_page_walks_nested_models_and_constraints():
    page = jobspec.page()
    assert "## `replay`" in page and "### `rollout.length_schedule[]`" in page
    assert "| `rollout.length_schedule[].from_version` |" in page
    assert "| `task.reward_limits.memory_bytes` |" in page
    mode = _row(page, "mode")
    assert "'sync', 'one_step_off', 'fully_async', 'reflow'" in mode
    assert "length ≤ 63" in _row(page, "name")
    assert "required" in _row(page, "model.path")
    # A mapping's key pattern is its keys', not a bound of the field itself.
    assert "matches" not in _row(page, "replay.sampler_args")


def test_the_cli_page_lists_every_command_and_no_environment_value(monkeypatch):
    monkeypatch.setenv("REFLOW_API_TOKEN", "never-on-a-page-0123456789")
    monkeypatch.setenv("REFLOW_URL", "http://example.invalid:1")
    page = cli.page()
    for command in ("reflow run", "reflow serve", "reflow submit", "reflow jobs", "reflow bench",
                    "reflow sim", "reflow models import-gguf", "reflow datasets export-gym"):
        assert f"## `{command}`" in page
    assert "| `--dry-run` |" in page and "`everysec`" in page
    assert "never-on-a-page" not in page and "example.invalid" not in page
    assert "`http://127.0.0.1:8000`" in page


def test_the_rest_page_lists_every_route_and_the_schemas_it_names():
    schema = rest.openapi()
    page = rest.page(schema)
    for path, ops in schema["paths"].items():
        for method in ops:
            assert f"### {method.upper()} `{path}`" in page
    assert "### POST `/v1/jobs`" in page and "[JobSubmission](#jobsubmission)" in page
    assert "### JobSubmission" in page and "### ApiError" in page
    # The spec's sections link to the job-spec page rather than being repeated.
    assert "[ReplayConfig](jobspec.md#replay)" in page
    assert "### ReplayConfig" not in page
    assert "| `limit` | query | integer (≥ 1, ≤ 1000) |" in page


def _source_metric_names() -> set[str]:
    """Every metric name written in a module that uses prometheus_client."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        if "docgen" in path.parts:
            continue
        text = path.read_text()
        if "prometheus_client" in text:
            names |= set(re.findall(r"[\"'](reflow_[a-z_]+)[\"']", text))
    return names


def test_the_metrics_page_has_every_metric_the_source_registers():
    page = metrics.page()
    listed = set(re.findall(r"^\| `(reflow_[a-z_]+)` \|", page, re.M))
    source = _source_metric_names()
    assert len(source) > 60
    missing = {n for n in source if n not in listed and f"{n}_total" not in listed}
    assert not missing, f"registered in the source but not on the metrics page: {missing}"
    row = next(line for line in page.splitlines() if "`reflow_api_requests_total`" in line)
    assert "| counter | `route`, `method`, `status` |" in row
    assert "| `reflow_trainer_step_seconds` | histogram | `job_id` |" in page


def test_the_metrics_page_has_one_section_per_service():
    docs = {s: metrics.metric_docs(r) for s, r in metrics.registries().items()}
    assert set(docs) == {"api", "scheduler", "replay", "rollout", "trainer", "sandbox"}
    for service, found in docs.items():
        assert found and all(d.name.startswith(f"reflow_{service}_") for d in found)


def test_the_authorization_pages_carry_the_live_tables():
    from reflow import redis_acl
    from reflow.authz import authorization_markdown

    assert authorization_markdown() in authz.rpc_page()
    assert "`Worker.SetRole`" in authz.rpc_page()
    assert redis_acl.markdown() in authz.redis_page()


def _hook():
    spec = importlib.util.spec_from_file_location("reference_hook",
                                                  REPO / "docs" / "hooks" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _config(tmp_path: Path):
    from mkdocs.config.defaults import MkDocsConfig

    (tmp_path / "docs").mkdir()
    config = MkDocsConfig()
    config.load_dict({"site_name": "t", "docs_dir": str(tmp_path / "docs"),
                      "site_dir": str(tmp_path / "site")})
    errors, _ = config.validate()
    assert not errors
    # What mkdocs sets while it runs a plugin's or hook's event.
    config.plugins._current_plugin = "reference"
    return config


def test_the_hook_adds_all_six_pages(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs toolchain is not installed")
    from mkdocs.structure.files import File, Files

    config = _config(tmp_path)
    stale = tmp_path / "docs" / "reference" / "cli.md"
    stale.parent.mkdir()
    stale.write_text("# a hand-written copy\n")
    files = Files([File("reference/cli.md", config.docs_dir, config.site_dir, True)])
    files = _hook().on_files(files, config=config)
    added = {f.src_uri: f for f in files if f.src_uri.startswith("reference/")}
    assert set(added) == set(pages()) == {
        "reference/jobspec.md", "reference/cli.md", "reference/rest.md",
        "reference/metrics.md", "reference/rpc-authorization.md", "reference/redis-users.md"}
    assert all(f.generated_by for f in added.values())
    assert added["reference/cli.md"].content_string.startswith("# CLI reference")
    assert "replay.replay_cap" in added["reference/jobspec.md"].content_string
