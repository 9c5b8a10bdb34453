import subprocess
import sys


def test_generated_grpc_code_is_up_to_date():
    result = subprocess.run([sys.executable, "-m", "reflow.protogen", "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_core_imports_no_torch_grpc_or_vllm():
    code = ("import sys, reflow.core.config, reflow.core.types, reflow.core.errors; "
            "bad = [m for m in ('torch', 'grpc', 'vllm', 'fastapi') if m in sys.modules]; "
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
