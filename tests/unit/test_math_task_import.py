"""The math task imports math-verify where it is built (the reward pool's
process builds it before reporting ready), not in its first reward call, whose
timeout (task.reward_timeout_s) the import would count against."""

import json
import subprocess  # nosec B404 # the test's own interpreter
import sys

CHECK = """
import sys
from reflow.tasks import TaskContext, build_task_by_name
assert "math_verify" not in sys.modules, "imported before the task was built"
build_task_by_name("math", {"path": "arith.jsonl"}, TaskContext(datasets_root=sys.argv[1]))
assert "math_verify" in sys.modules, "not imported when the task was built"
"""


def test_building_the_math_task_imports_math_verify(tmp_path):
    (tmp_path / "arith.jsonl").write_text(
        "".join(json.dumps({"question": f"{i} + {i}?", "answer": str(2 * i)}) + "\n"
                for i in range(20)))
    # A fresh interpreter: this one may have imported math-verify already.
    done = subprocess.run([sys.executable, "-c", CHECK, str(tmp_path)],  # nosec B603
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
