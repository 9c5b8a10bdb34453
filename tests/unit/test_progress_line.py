"""`reflow run`'s progress line: the last one printed shows the job's final phase."""

from reflow import launcher


def _job(step: int, phase: str) -> dict:
    return {"step": step, "phase": phase, "reward_mean": 0.25, "trainer_tokens_per_s": 1234.0,
            "policy_version": step}


def test_line_names_step_phase_and_rates():
    line = launcher.progress_line(_job(75, "RUNNING"), num_steps=150, elapsed_s=12.0)
    assert line.startswith("[" + "#" * 12 + "-" * 12 + "] step 75/150  running ")
    assert "reward 0.250  1234 tok/s  v75     12s" in line


def test_bar_is_full_and_no_longer_at_or_past_the_last_step():
    line = launcher.progress_line(_job(151, "SUCCEEDED"), num_steps=150, elapsed_s=1.0)
    assert line.startswith("[" + "#" * 24 + "] step 151/150  succeeded")


def test_without_a_terminal_the_final_phase_is_printed_even_within_10_s(capsys, monkeypatch):
    monkeypatch.setattr(launcher.sys.stdout, "isatty", lambda: False)
    progress = launcher._Progress(num_steps=150)
    progress.show(_job(150, "RUNNING"))
    progress.show(_job(150, "RUNNING"))  # within 10 s of the last line: not printed
    progress.show(_job(150, "SUCCEEDED"))
    progress.close()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert "running" in lines[0]
    assert "step 150/150  succeeded" in lines[-1]


def test_on_a_terminal_the_line_is_redrawn_and_ends_in_the_final_phase(capsys, monkeypatch):
    monkeypatch.setattr(launcher.sys.stdout, "isatty", lambda: True)
    progress = launcher._Progress(num_steps=150)
    progress.show(_job(150, "RUNNING"))
    progress.show(_job(150, "FAILED"))
    progress.close()
    out = capsys.readouterr().out
    assert out.endswith("\n")
    assert "failed" in out.rstrip("\n").rsplit("\r", 1)[-1]
