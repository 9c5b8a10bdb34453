"""The evidence behind the learning tables: committed per-run files (bench/evidence.py),
a pre-registered study's analysis (bench/study_analysis.py), the one statistics
convention (bench/convergence_stats.py) and the check that every table in the docs is
rebuilt from committed data (bench/convergence_report.py)."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


cs = _load("convergence_stats")
evidence = _load("evidence")
sa = _load("study_analysis")
report = _load("convergence_report")


def test_t_quantile_matches_the_table_and_goes_beyond_it():
    for df, t in ((1, 12.706), (2, 4.303), (5, 2.571), (8, 2.306), (30, 2.042)):
        assert cs.t_quantile(0.975, df) == pytest.approx(t, abs=1e-3)
    # 99.5 % one-sided quantiles from the usual table.
    assert cs.t_quantile(0.995, 5) == pytest.approx(4.032, abs=1e-3)
    assert cs.t_quantile(0.995, 10) == pytest.approx(3.169, abs=1e-3)
    assert cs.t_quantile(0.025, 5) == pytest.approx(-2.571, abs=1e-3)
    assert cs.t_cdf(0.0, 7) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        cs.t_quantile(1.0, 5)


def test_paired_t_by_hand_and_the_bonferroni_level():
    # Differences 1, 1, 2.5: mean 1.5, s = sqrt(0.75), t(0.975, 2) = 4.303.
    out = cs.paired_t([1.0, 2.0, 3.5], [0.0, 1.0, 1.0])
    half = 4.302653 * math.sqrt(0.75) / math.sqrt(3)
    assert out["estimate"] == pytest.approx(1.5)
    assert (out["low"], out["high"]) == pytest.approx((1.5 - half, 1.5 + half), abs=1e-5)
    assert out["per_seed"] == [1.0, 1.0, 2.5]
    assert cs.corrected_level(8) == pytest.approx(0.99375)
    wider = cs.paired_t([1.0, 2.0, 3.5], [0.0, 1.0, 1.0], cs.corrected_level(8))
    assert wider["low"] < out["low"] and wider["high"] > out["high"]
    one = cs.paired_t([1.0], [0.0])
    assert math.isnan(one["low"]) and one["estimate"] == 1.0
    with pytest.raises(ValueError):
        cs.paired_t([1.0, 2.0], [1.0])


def _records(n, step_s=10.0, fresh=8, stale=0, replay=8, snapshot_s=1.0):
    out = []
    for i in range(1, n + 1):
        out.append({"step": i, "policy_version": i,
                    # wall_time_s counts the snapshots written before this step.
                    "wall_time_s": i * step_s + (i - 1) * snapshot_s, "step_time_s": step_s,
                    "reward_mean": 0.1 * i, "first_use_reward_mean": 0.05 * i,
                    "fresh_samples": fresh, "stale_samples": stale, "replay_samples": replay,
                    "replay_fraction": replay / (fresh + stale + replay),
                    "policy_snapshot_s": snapshot_s, "trainer_idle_ratio": 0.1,
                    "evicted_unused_samples_total": 0, "stale_clip_fraction": 0.01,
                    "engine_step_ms": 3.0})
    return out


def test_a_run_file_keeps_the_columns_tables_read(tmp_path):
    records = _records(4)
    records[2]["eval_reward"] = 0.5
    path = evidence.write_run(tmp_path, "reflow", 3, command=[str(REPO / "x"), "run"],
                              records=records, elapsed_s=12.345678901, returncode=0,
                              machine_before={"load_avg": [1.0]}, machine_after={},
                              extra={"heldout": {"p": 1}})
    assert path == tmp_path / "reflow" / "seed3.json"
    back = evidence.read_run(path)
    assert back["command"] == ["x", "run"]  # relative to the repository
    assert back["elapsed_s"] == pytest.approx(12.3457)
    assert back["heldout"] == {"p": 1} and back["num_steps"] == 4
    assert [r["step"] for r in back["records"]] == [1, 2, 3, 4]
    assert "engine_step_ms" not in back["records"][0]  # not a table's field
    assert back["records"][2]["eval_reward"] == 0.5 and "eval_reward" not in back["records"][0]
    body = json.loads(path.read_text())
    body["schema"] = 99
    path.write_text(json.dumps(body))
    with pytest.raises(ValueError, match="schema"):
        evidence.read_run(path)


def test_the_policy_at_a_point_is_the_last_snapshot_at_or_before_it():
    records = _records(10)  # training wall 10, 20, ..., 100 s; 8 first-use samples a step
    assert sa.training_wall(records).tolist() == [10.0 * i for i in range(1, 11)]
    assert sa.snapshot_at(records, "wall_time_s", 45.0, 1) == 4
    assert sa.snapshot_at(records, "wall_time_s", 45.0, 3) == 3
    assert sa.snapshot_at(records, "wall_time_s", 5.0, 1) == 0  # the initial weights
    assert sa.snapshot_at(records, "wall_time_s", 1e6, 4) == 10  # the final policy
    assert sa.snapshot_at(records, "first_use_samples", 24, 1) == 3
    assert sa.point_position(records, 3) == {"training_wall_s": 30.0, "first_use_samples": 24}
    assert sa.steady_replay(records, 3) == pytest.approx(0.5)


def _study(tmp_path, runs_per_entry):
    data = {"config": "examples/math_replay.yaml", "seeds": "0-3",
            "entries": {"reflow": ["mode=reflow"], "fully_async": ["mode=fully_async"]},
            "reference": "reflow", "comparisons": ["fully_async"],
            "primary": {"points": {"wall_time_s": 50}, "snapshot_interval": 1},
            "gate": {"entries": ["reflow"], "min_replay_fraction": 0.3, "steady_from_step": 2}}
    directory = tmp_path / "data" / "toy"
    directory.mkdir(parents=True)
    (directory / "study.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    for entry, scores in runs_per_entry.items():
        for seed, score in enumerate(scores):
            evidence.write_run(directory, entry, seed, command=["reflow"], records=_records(6),
                               elapsed_s=1.0, returncode=0, machine_before={}, machine_after={},
                               extra={"heldout": {"wall_time_s": {"eval_pass_at_1": score}}})
    return sa.Study.from_yaml("toy", data), directory


def test_the_primary_table_reads_paired_corrected_intervals(tmp_path):
    study, directory = _study(tmp_path, {"reflow": [0.50, 0.61, 0.42, 0.55],
                                         "fully_async": [0.40, 0.50, 0.33, 0.44]})
    tables = sa.tables(study, directory)
    assert tables["status"].startswith("8 of 8 runs")
    primary = tables["primary"]
    stat = cs.paired_t([0.50, 0.61, 0.42, 0.55], [0.40, 0.50, 0.33, 0.44])
    assert f"{stat['estimate']:+.3f} [{stat['low']:+.3f}, {stat['high']:+.3f}]" in primary
    # One comparison at one point: no widening; ahead, the interval above 0.
    assert study.num_intervals == 1 and stat["low"] > 0
    assert "reflow against fully_async at equal training wall time: reference ahead" in primary
    mixed, directory = _study(tmp_path / "b", {"reflow": [0.50, 0.41, 0.42, 0.55],
                                               "fully_async": [0.40, 0.50, 0.33, 0.60]})
    assert "not distinguishable" in sa.tables(mixed, directory)["primary"]


def test_a_study_names_only_its_entries():
    with pytest.raises(ValueError, match="not entries"):
        sa.Study.from_yaml("bad", {"config": "x.yaml", "entries": {"a": []}, "reference": "b",
                                   "primary": {"points": {"wall_time_s": 1}}})
    with pytest.raises(ValueError, match="seed"):
        sa.Study.from_yaml("bad", {"config": "x.yaml", "entries": {"a": ["seed=3"]},
                                   "reference": "a", "primary": {"points": {"wall_time_s": 1}}})


def test_a_table_in_the_docs_that_differs_from_its_data_fails(tmp_path):
    study, directory = _study(tmp_path, {"reflow": [0.5, 0.6], "fully_async": [0.4, 0.5]})
    root = tmp_path / "repo"
    (root / "bench").mkdir(parents=True)
    (root / "docs").mkdir()
    table = sa.tables(study, directory)["primary"]
    page = root / "bench" / "RESULTS.md"
    page.write_text(f"# Results\n\n<!-- table toy/primary -->\n{table}\n<!-- /table -->\n")
    assert report.sync_tables(root, write=False, data=tmp_path / "data") == []
    tampered = page.read_text().replace("0.550", "0.600", 1)
    assert tampered != page.read_text()
    page.write_text(tampered)
    problems = report.sync_tables(root, write=False, data=tmp_path / "data")
    assert len(problems) == 1 and "toy/primary differs" in problems[0]
    assert report.sync_tables(root, write=True, data=tmp_path / "data")
    assert report.sync_tables(root, write=False, data=tmp_path / "data") == []
    (root / "docs" / "page.md").write_text("<!-- table toy/nothing -->\n|x|\n<!-- /table -->\n")
    assert "no committed study" in report.sync_tables(root, False, tmp_path / "data")[0]


def test_every_learning_table_in_the_repository_is_rebuilt_from_committed_data():
    problems = report.sync_tables(REPO, write=False)
    assert not problems, "\n".join(problems)
    marked = sum(len(report.TABLE.findall(p.read_text())) for p in report.pages(REPO))
    assert marked >= 1, "no learning table is marked: nothing would be checked"
