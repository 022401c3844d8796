"""Kubernetes manifests (kustomize base + cpu/gpu overlays) and their offline validation (`make k8s-validate`)."""
