"""The Kubernetes manifests, offline (no cluster): each overlay builds with `kubectl kustomize` and validates
strictly against the Kubernetes schemas and KEDA's vendored CRD (infra/k8s/validate.py, `make k8s-validate`),
and says what an operator needs: probes on the health endpoints, resources, secrets only from the Secret, the
trainer as a multi-process torchrun job, KEDA scaling of rollout and env workers on consumer-group lag.

    pytest -q tests/component/test_k8s_manifests.py
"""

from __future__ import annotations

import copy
import functools

import pytest

from infra.k8s import validate as k8s
from shared.contracts import streams

OVERLAYS = {p.name: p for p in k8s.OVERLAYS}
SECRET_VARS = {"DATABASE_URL", "API_TOKEN", "POSTGRES_PASSWORD"}
APP_IMAGES = ("flywheel-",)


@functools.cache
def built(overlay: str) -> tuple[dict, ...]:
    return tuple(k8s.build(OVERLAYS[overlay]))


def find(overlay: str, kind: str, name: str) -> dict:
    return copy.deepcopy(next(d for d in built(overlay) if d["kind"] == kind and d["metadata"]["name"] == name))


def pod_containers(doc: dict) -> list[dict]:
    return doc["spec"]["template"]["spec"]["containers"] if "template" in doc.get("spec", {}) else []


def test_both_overlays_exist():
    assert {"cpu", "gpu"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_overlay_builds_and_every_resource_validates(overlay):
    docs = built(overlay)
    errors = [e for e in map(k8s.validate_resource, docs) if e]
    assert not errors, errors
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Job", "Service", "ConfigMap", "ScaledObject", "StatefulSet"} <= kinds
    assert not [d for d in docs if d["kind"] == "Secret"], "secrets are created by the operator, never committed"


def test_validation_rejects_unknown_fields_and_bad_types():
    deployment = find("cpu", "Deployment", "api")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}  # typo
    assert "readinesProbe" in (k8s.validate_resource(deployment) or "")
    scaled = find("cpu", "ScaledObject", "rollout-worker")
    scaled["spec"]["maxReplicas"] = 4  # KEDA calls it maxReplicaCount
    assert "maxReplicas" in (k8s.validate_resource(scaled) or "")
    scaled = find("cpu", "ScaledObject", "rollout-worker")
    scaled["spec"]["triggers"][0]["metadata"]["lagCount"] = 64  # trigger metadata values are strings
    assert k8s.validate_resource(scaled)


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_every_container_has_probes_and_resources(overlay):
    for doc in built(overlay):
        for c in pod_containers(doc):
            where = f"{overlay}: {doc['kind']}/{doc['metadata']['name']}"
            assert c["resources"]["requests"].get("cpu") and c["resources"]["requests"].get("memory"), where
            assert c["resources"]["limits"].get("memory"), f"{where}: a memory limit"
            if doc["kind"] in ("Deployment", "StatefulSet") or doc["metadata"]["name"] == "trainer":
                assert c.get("readinessProbe") and c.get("livenessProbe"), f"{where}: readiness and liveness"


def test_http_probes_hit_the_health_endpoint_on_the_served_port():
    served = {"api": ("API_PORT", "/readyz"), "weight-server": ("WEIGHT_SERVER_PORT", "/healthz")}
    config = find("cpu", "ConfigMap", "flywheel-config")["data"]
    for doc in built("cpu"):
        for c in pod_containers(doc):
            probe = c.get("livenessProbe", {}).get("httpGet")
            if not probe:
                continue
            env = {**config, **{e["name"]: e["value"] for e in c.get("env", []) if "value" in e}}
            port_var, ready_path = served.get(doc["metadata"]["name"], ("HEALTH_PORT", "/healthz"))
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert ports[probe["port"]] == int(env[port_var]), f"{doc['metadata']['name']}: probe on {port_var}"
            assert probe["path"] == "/healthz"
            assert c["readinessProbe"]["httpGet"]["path"] == ready_path


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_secrets_come_only_from_the_secret(overlay):
    for doc in built(overlay):
        if doc["kind"] == "ConfigMap":
            assert not SECRET_VARS & set(doc["data"]), "secrets do not belong in a ConfigMap"
        for c in pod_containers(doc):
            for e in c.get("env", []):
                if e["name"] in SECRET_VARS:
                    assert "value" not in e, f"{doc['metadata']['name']}: {e['name']} given in clear"
                    assert e["valueFrom"]["secretKeyRef"]["name"] == "flywheel-secrets"


def test_trainer_is_a_multiprocess_torchrun_job():
    for overlay in OVERLAYS:
        job = find(overlay, "Job", "trainer")
        c = job["spec"]["template"]["spec"]["containers"][0]
        command = " ".join(c["command"] + c.get("args", []))
        assert "torchrun" in command and "-m services.trainer.main" in command
        assert "--nproc-per-node=\"$NPROC_PER_NODE\"" in command
        nproc = int(next(e["value"] for e in c["env"] if e["name"] == "NPROC_PER_NODE"))
        assert nproc >= 2, f"{overlay}: a multi-process trainer"
        if overlay == "gpu":
            assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == nproc, "one process per GPU"
            assert "flywheel-trainer-gpu" in c["image"]
        else:
            assert "flywheel-trainer:" in c["image"]


def test_keda_scales_rollout_and_env_workers_on_consumer_group_lag():
    expected = {"rollout-worker": (streams.ROLLOUT_TASKS, streams.GROUP_ROLLOUT),
                "env-worker": (streams.ENV_REQUESTS, streams.GROUP_ENV)}
    for overlay in OVERLAYS:
        deployments = {d["metadata"]["name"] for d in built(overlay) if d["kind"] == "Deployment"}
        for name, (stream, group) in expected.items():
            scaled = find(overlay, "ScaledObject", name)
            assert scaled["spec"]["scaleTargetRef"]["name"] in deployments
            assert scaled["spec"]["maxReplicaCount"] > scaled["spec"]["minReplicaCount"] >= 1
            (trigger,) = scaled["spec"]["triggers"]
            assert trigger["type"] == "redis-streams"
            meta = trigger["metadata"]
            assert (meta["stream"], meta["consumerGroup"]) == (stream, group)
            assert int(meta["lagCount"]) > 0, "scale on the group's lag, not on pending entries"
            namespace = scaled["metadata"]["namespace"]
            assert meta["address"] == f"redis.{namespace}.svc.cluster.local:6379", \
                "KEDA's operator runs in its own namespace: name Redis by its cluster DNS name"


def test_gpu_overlay_swaps_in_the_vllm_rollout_image():
    cpu = pod_containers(find("cpu", "Deployment", "rollout-worker"))[0]
    gpu = pod_containers(find("gpu", "Deployment", "rollout-worker"))[0]
    assert "flywheel-cpu:" in cpu["image"] and "nvidia.com/gpu" not in cpu["resources"]["limits"]
    assert "flywheel-rollout-gpu:" in gpu["image"] and int(gpu["resources"]["limits"]["nvidia.com/gpu"]) == 1
    for overlay in OVERLAYS:
        for doc in built(overlay):
            for c in pod_containers(doc):
                if c["image"].split("/")[-1].startswith(APP_IMAGES):
                    assert "/" in c["image"] and ":" in c["image"], f"{overlay}: {c['image']} needs a registry and tag"


def test_env_worker_may_build_sandboxes_and_gvisor_overlay_runs_it_under_runsc():
    """The namespaces sandbox needs unshare/clone/mount (RuntimeDefault seccomp refuses them); still non-root,
    no capabilities, no privilege escalation. overlays/cpu-gvisor adds the RuntimeClass and uses it."""
    container = find("cpu", "Deployment", "env-worker")["spec"]["template"]["spec"]["containers"][0]
    security = container["securityContext"]
    assert security["seccompProfile"]["type"] == "Unconfined" and security["capabilities"]["drop"] == ["ALL"]
    assert security["allowPrivilegeEscalation"] is False
    gvisor = find("cpu-gvisor", "Deployment", "env-worker")["spec"]["template"]["spec"]
    assert gvisor["runtimeClassName"] == "gvisor"
    assert find("cpu-gvisor", "RuntimeClass", "gvisor")["handler"] == "runsc"
