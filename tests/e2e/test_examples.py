"""Every task example runs as a user runs it (`reflow run examples/X.yaml`), a few
steps each. The math example runs on the real SmolLM2-135M-Instruct it names
(imported from the shipped GGUF once per session); the others on the tiny
model, with the chat template's minimal fallback, to keep the suite short:
they check the plumbing of their task (a multi-turn episode loop, a
reasoning-gym scorer), not what a model learns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from reflow.tasks.export import export_gym

REPO = Path(__file__).resolve().parents[2]
ARITHMETIC = ('{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, '
              '"operators": ["+", "-", "*"], "allow_parentheses": false, "allow_negation": false}')
SMALL = ["trainer.num_steps=2", "rollout.kv_cache_gb=0.25"]


def _scrape(run_dir: Path, client: httpx.Client) -> dict[str, float]:
    """The rollout worker's counters, by metric name (labels dropped)."""
    targets = json.loads((run_dir / "prometheus-targets.json").read_text())
    found: dict[str, float] = {}
    for target in targets:
        if target["labels"]["service"].startswith("rollout"):
            for line in client.get(f"http://{target['targets'][0]}/metrics").text.splitlines():
                if line.startswith("reflow_rollout_") and "{" in line:
                    name = line.split("{", 1)[0]
                    found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def run_example(name: str, out: Path, overrides: list[str]) -> tuple[list[dict], dict]:
    """Run an example to the end; its metrics records and its rollout worker's last
    scraped counters."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "reflow.cli", "run", str(REPO / "examples" / name),
         "--out", str(out), *overrides],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    counters: dict[str, float] = {}
    deadline = time.monotonic() + 900
    with httpx.Client(timeout=5) as client:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                counters = _scrape(out, client) or counters
            except (OSError, httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.25)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, output[-4000:]
    assert json.loads((out / "summary.json").read_text())["phase"] == "SUCCEEDED"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return records, counters


@pytest.mark.slow
# math.yaml is math_lora.yaml without the adapters, math_replay.yaml is it with an engine
# batch limit, step-by-step answers and δ = 2 (all three parse in test_config.py; the
# limit's engine path runs here, at a limit the step's samples, the evaluation and the
# sync probe fit under); the full-weight path on SmolLM2 runs in the openai agent example.
@pytest.mark.parametrize("example", ["math_lora.yaml"])
def test_the_math_example_trains_smollm2_with_its_chat_template(example, smollm2_model, tmp_path):
    datasets = Path(os.environ["REFLOW_DATASETS_DIR"])
    export_gym("basic_arithmetic", datasets / "arithmetic.jsonl", 200, ARITHMETIC)
    records, counters = run_example(example, tmp_path / "run", [
        *SMALL, "trainer.batch_size=8", "rollout.max_tokens=48", "eval.interval=2",
        "eval.num_prompts=2", "eval.k=2", "trainer.policy_snapshot_interval=1",
        "rollout.max_num_seqs=16"])
    assert [r["step"] for r in records] == [1, 2]
    # The held-out split was scored twice: the initial weights, then version 2,
    # two samples a problem, with pass@k and maj@k (math gives final answers).
    assert records[0]["eval_policy_version"] == 0 and records[-1]["eval_policy_version"] == 2
    for r in records:
        assert r["eval_k"] == 2 and r["eval_samples"] + r["eval_errors"] == 4
        metrics = [r[f"eval_{m}"] for m in ("pass_at_1", "pass_at_k", "avg_at_k", "maj_at_k")]
        assert all(0.0 <= m <= 1.0 for m in metrics), metrics
        assert r["eval_pass_at_k"] >= r["eval_pass_at_1"]
        assert r["eval_maj_at_k"] <= r["eval_pass_at_k"]  # the voted answer is one of the two
        if r["eval_errors"] == 0:  # math scores 0 or 1: the mean reward is pass@1
            assert abs(r["eval_pass_at_1"] - r["eval_reward"]) < 1e-9
    assert counters["reflow_rollout_scored_samples_total"] >= 16
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in records)
    # Every sync was checked: the engine samples from what the trainer published.
    assert all(r["sync_check_logprob_diff"] < 1e-3 for r in records)
    if example == "math_lora.yaml":
        # Rank-16 adapters on SmolLM2's 30 blocks in float32, r x (in + out) per
        # projection: q and o 576 -> 576, k and v 576 -> 192, gate, up and down
        # 576 <-> 1536. 19.5 MB, 3.5 % of the model's bytes.
        assert records[0]["weight_sync_bytes"] == 30 * 16 * 4 * (
            2 * (576 + 576) + 2 * (576 + 192) + 3 * (576 + 1536)) == 19_537_920
        adapter = tmp_path / "run" / "checkpoint" / "adapter"
        assert (adapter / "adapter_model.safetensors").is_file()
        assert (tmp_path / "run" / "checkpoint" / "model.safetensors").is_file()
    # The policy after step 1, whole (LoRA merged), for `reflow eval` after the run
    # (tests/unit/test_policy_snapshots.py scores one; bench/study.py on vLLM).
    snapshot = tmp_path / "run" / "policies" / "step-1"
    assert json.loads((snapshot / "reflow-policy.json").read_text())["step"] == 1
    assert (snapshot / "model.safetensors").is_file()
    assert 0 < records[0]["policy_snapshot_s"] and "policy_snapshot_s" not in records[-1]


@pytest.mark.slow
def test_the_reasoning_gym_example_scores_with_the_generator(tiny_model, tmp_path):
    records, counters = run_example("reasoning_gym.yaml", tmp_path / "run", [
        *SMALL, f"model.path={tiny_model}", "trainer.batch_size=16", "rollout.max_tokens=16"])
    assert len(records) == 2 and counters["reflow_rollout_scored_samples_total"] >= 32
    assert counters.get("reflow_rollout_reward_errors_total", 0) == 0


@pytest.mark.slow
@pytest.mark.parametrize("example", ["guess_number.yaml", "calculator.yaml"])
def test_the_multi_turn_examples_play_episodes(example, tiny_model, tmp_path):
    records, counters = run_example(example, tmp_path / "run", [
        *SMALL, f"model.path={tiny_model}", "rollout.max_tokens=12",
        "task.args.max_episode_tokens=160"])
    assert len(records) == 2
    episodes = counters["reflow_rollout_episodes_total"]
    # Each sample is one episode. The last scrape comes at most a poll before the
    # rollout worker stops, which it does first when the job ends: the episodes of
    # the first batch (16) at least are in it.
    assert episodes >= 16
    turns = counters["reflow_rollout_episode_turns_total"]
    if example == "guess_number.yaml":
        # Several turns each, the game's feedback between them: a tiny random model
        # rarely guesses right, so most episodes run to max_turns or the token budget
        # (tests/unit/test_worker_multiturn.py pins the turns exactly).
        assert turns >= 2 * episodes
    else:
        # A turn without a tool call is the final answer: a tiny random model never
        # writes a tool call, so each episode is one turn.
        assert turns >= episodes
    # Observation tokens are not trained: fewer loss tokens than generated and observed.
    assert all(r["trained_tokens"] > 0 for r in records)


@pytest.mark.slow
@pytest.mark.parametrize("example", ["python_tool.yaml", "code_tests.yaml", "coding_agent.yaml"])
def test_the_code_examples_play_episodes_beside_a_sandbox(example, tiny_model, tmp_path):
    """The plumbing: `reflow run` starts the sandbox and the episodes play. A tiny
    random model writes no code block, so programs are judged in
    tests/unit/test_code_tasks.py (scripted turns, the real sandbox)."""
    if example == "python_tool.yaml":
        export_gym("basic_arithmetic", Path(os.environ["REFLOW_DATASETS_DIR"])
                   / "arithmetic.jsonl", 200, ARITHMETIC)
    turns = [] if example == "code_tests.yaml" else ["task.args.max_turns=2"]
    out = tmp_path / "run"
    records, counters = run_example(example, out, [
        *SMALL, f"model.path={tiny_model}", "trainer.batch_size=8", "rollout.group_size=4",
        "rollout.max_tokens=12", "task.args.max_episode_tokens=160", "eval.interval=0",
        *turns])
    # `reflow run` started the sandbox the task asks for.
    assert "sandbox" in json.loads((out / "endpoints.json").read_text())
    assert len(records) == 2 and all(r["trained_tokens"] > 0 for r in records)
    # The episodes of the first batch at least, each of one turn or more, and none
    # whose environment failed.
    episodes = counters["reflow_rollout_episodes_total"]
    assert episodes >= 8 and counters["reflow_rollout_episode_turns_total"] >= episodes
    assert counters.get("reflow_rollout_reward_errors_total", 0) == 0


@pytest.mark.slow
def test_the_openai_agent_example_trains_smollm2_through_the_worker_s_endpoint(smollm2_model,
                                                                               tmp_path):
    """The agent example as a user runs it, its agent registered with --agents-dir:
    every episode is the agent script's calls through the rollout worker's endpoint
    (tests/integration/test_agent_episode.py pins the tokens, log-probs and masks).
    On SmolLM2, whose chat template renders its own turns back as it sampled them:
    the tiny model's character tokenizer decodes with spaces between characters, so
    its turns never round-trip and every call would be refused, as it should be."""
    export_gym("basic_arithmetic", Path(os.environ["REFLOW_DATASETS_DIR"]) / "arithmetic.jsonl",
               200, ARITHMETIC)
    records, counters = run_example("openai_agent.yaml", tmp_path / "run", [
        "trainer.num_steps=1", "rollout.kv_cache_gb=0.25", "trainer.batch_size=8",
        "rollout.group_size=4", "rollout.max_tokens=32", "eval.interval=0", "--agents-dir",
        str(REPO / "examples" / "agents")])
    assert len(records) == 1 and records[0]["trained_tokens"] > 0
    # One episode a sample, each of one call or two (the script asks again when the
    # reply has no \boxed{}), and none refused or failed.
    episodes = counters["reflow_rollout_episodes_total"]
    assert episodes >= 8
    assert episodes <= counters["reflow_rollout_episode_turns_total"] <= 2 * episodes
    # None trained was refused or failed. (The worker's counters also hold the agents
    # that the run's end stopped mid-episode, never trained.)
    assert records[0]["reward_error_samples"] == 0
