"""Which checkpoint tensors the vLLM-backed engines hand vLLM together for a delta (services/rollout_worker/
engines/deltas.py): vLLM rebuilds a layer from all its tensors, so every tensor of a touched layer must go, fused
parts and biases included. Runs without vLLM installed."""

from __future__ import annotations

from services.rollout_worker.engines.deltas import layer_groups, with_layer_mates

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def test_fused_parts_and_their_biases_share_one_layer_and_others_stay_apart():
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.bias",
             "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
             "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
             "model.layers.1.self_attn.q_proj.weight", "model.norm.weight", "model.embed_tokens.weight"]
    groups = layer_groups(names, PACKED)
    assert groups["model.layers.0.self_attn.q_proj.weight"] == "model.layers.0.self_attn.qkv_proj"
    assert groups["model.layers.0.self_attn.k_proj.bias"] == groups["model.layers.0.self_attn.v_proj.weight"] \
        == "model.layers.0.self_attn.qkv_proj"
    assert groups["model.layers.0.mlp.gate_proj.weight"] == groups["model.layers.0.mlp.up_proj.weight"] \
        == "model.layers.0.mlp.gate_up_proj"
    assert groups["model.layers.0.self_attn.o_proj.weight"] == "model.layers.0.self_attn.o_proj"
    assert groups["model.layers.1.self_attn.q_proj.weight"] == "model.layers.1.self_attn.qkv_proj"  # not layer 0's
    assert groups["model.norm.weight"] == "model.norm" and groups["model.embed_tokens.weight"] == "model.embed_tokens"
    assert layer_groups(names, {})["model.layers.0.self_attn.q_proj.weight"] == "model.layers.0.self_attn.q_proj"


def test_layer_mates_are_the_unchanged_tensors_of_each_touched_layer():
    current = {n: f"old {n}" for n in ["l.0.attn.q_proj.weight", "l.0.attn.k_proj.weight", "l.0.attn.v_proj.bias",
                                       "l.0.attn.o_proj.weight", "l.1.attn.q_proj.weight", "norm.weight"]}
    send = with_layer_mates(current, {"l.0.attn.q_proj.weight": "new", "norm.weight": "new"}, PACKED)
    assert send == {"l.0.attn.q_proj.weight": "new", "l.0.attn.k_proj.weight": "old l.0.attn.k_proj.weight",
                    "l.0.attn.v_proj.bias": "old l.0.attn.v_proj.bias", "norm.weight": "new"}
