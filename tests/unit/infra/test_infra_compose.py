"""docker-compose.yml and infra/docker checked statically (no docker engine here): the compose file's
structure, healthchecks, dependency conditions, entry points, images, profiles and security defaults.
`docker compose config` also runs when the compose plugin is installed.

    pytest -q tests/unit/infra/test_infra_compose.py
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from infra.local_stack import SERVICES

REPO = Path(__file__).resolve().parents[3]
COMPOSE_TEXT = (REPO / "docker-compose.yml").read_text()
COMPOSE = yaml.safe_load(COMPOSE_TEXT)  # PyYAML resolves the `<<:` merge keys compose uses
SERVICES_YML: dict = COMPOSE["services"]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SCRIPTS: dict[str, str] = PYPROJECT["project"]["scripts"]
EXTRAS = set(PYPROJECT["project"]["optional-dependencies"])
REQUIRED_ENV = {"POSTGRES_PASSWORD": "pw", "API_TOKEN": "token"}
ONE_SHOT = {"migrate"}
BACKING = {"redis", "postgres"}

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
    return {n: s for n, s in SERVICES_YML.items() if n not in BACKING}


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
    dockerfiles = {s["build"]["dockerfile"] for s in SERVICES_YML.values() if "build" in s}
    assert len(dockerfiles) >= 3, "expected separate cpu, trainer and rollout-gpu images"
    for path in dockerfiles:
        text = (REPO / path).read_text()
        for extras in re.findall(r'-e "\.\[([\w,-]+)\]"', text):
            assert set(extras.split(",")) <= EXTRAS, f"{path}: unknown extras in {extras}"
        cmd = re.search(r'^CMD \["([\w-]+)"', text, re.M)
        assert cmd and cmd.group(1) in SCRIPTS, f"{path}: CMD must name a console script"


def test_cpu_and_gpu_profiles():
    profiles = {p for s in SERVICES_YML.values() for p in s.get("profiles", [])}
    assert {"cpu", "gpu"} <= profiles
    for name, svc in SERVICES_YML.items():
        if "gpu" in svc.get("profiles", []):
            devices = svc["deploy"]["resources"]["reservations"]["devices"]
            assert any("gpu" in d["capabilities"] for d in devices), f"{name}: reserve a GPU"
    gpu_images = {SERVICES_YML[n]["build"]["dockerfile"] for n in ("rollout-worker-gpu", "trainer-gpu")}
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
    assert {"weight-server", "rollout-worker", "trainer", "rollout-worker-gpu", "trainer-gpu"} <= users


def docker_compose() -> list[str] | None:
    if shutil.which("docker"):
        ok = subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0
        if ok:
            return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


@pytest.mark.skipif(docker_compose() is None, reason="the docker compose client is not installed")
def test_docker_compose_config_accepts_the_file():
    base = docker_compose() + ["-f", str(REPO / "docker-compose.yml")]
    env = {**os.environ, **REQUIRED_ENV}
    for profile in ("cpu", "gpu"):
        out = subprocess.run([*base, "--profile", profile, "config", "-q"], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
    missing = {k: v for k, v in env.items() if k != "POSTGRES_PASSWORD"}
    out = subprocess.run([*base, "config", "-q"], env=missing, capture_output=True, text=True)
    assert out.returncode != 0 and "POSTGRES_PASSWORD" in out.stderr
