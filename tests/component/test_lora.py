"""LoRA runs over the real services.

- Adapters through a real weight-server process (HTTP upload, manifest, Postgres row, announcement on real
  Redis) to the rollout worker's reload path (RunRegistry + HF engine): two LoRA runs on one base share one
  engine; each serves, bit for bit, the adapter the trainer (verl, PolicyEngine.export_adapter) exported for the
  version it reports; a new version of one run leaves the other's adapter and version alone; one batch mixing
  both runs gives each run the tokens and logprobs its adapter gives alone; an adapter trained on another base
  is refused and the run keeps its version.
- The trainer's LoRA engine: adapter-only gradients and optimizer state, the reference is the base, a
  checkpoint restores adapter and optimizer state.
- vLLM in process (slow, `.venv-vllm`): each run's adapter as a `LoRARequest`, alone and in one batch, checked
  against HF/PEFT.
(The demo's task learned by a LoRA run on the whole stack: tests/learning/test_lora_learning.py.)
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import redis
import torch
from fixtures.rollout_stack import insert_run, run_config
from safetensors.torch import load_file
from sqlalchemy import create_engine
from trainer_testlib import WeightServer

from services.rollout_worker.engines import AdapterView, SamplingParams
from services.rollout_worker.run_engines import RunRegistry
from services.trainer.publisher import WeightPublisher
from shared.contracts.messages import decode
from shared.contracts.run_config import AlgorithmConfig
from shared.contracts.streams import WEIGHTS
from shared.weights.manifest import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MANIFEST, BaseModelRef, base_model_digest
from tests.support.demo import LORA_INIT_STD, prompt_ids
from tests.support.tiny_model import build_number_model

ADAPTERS = {"a": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
            "b": {"rank": 8, "alpha": 16, "target_modules": "all-linear"},
            "c": {"rank": 4, "target_modules": "all-linear"}}  # never publishes: served the base (version 0)
GREEDY = SamplingParams(temperature=0.0)


class AdapterTrainer:
    """verl's LoRA engine for one run; a 'step' moves every adapter weight (a stand-in for an optimizer step
    that keeps this test fast), then the adapter is exported as the trainer service exports it."""

    def __init__(self, model: Path, lora: dict, staging: Path, seed: int):
        from services.trainer.engine import PolicyEngine

        self.engine = PolicyEngine(str(model), AlgorithmConfig(lora=lora, kl_coef=0.1))
        self.staging, self.gen = staging, torch.Generator().manual_seed(seed)
        self.exports: dict[int, dict[str, torch.Tensor]] = {}

    def step_and_export(self, version: int) -> Path:
        with torch.no_grad():
            for name, p in self.engine.peft_model.named_parameters():
                if "lora_" in name:
                    local = p.to_local() if hasattr(p, "to_local") else p
                    local.add_(0.3 * torch.randn(local.shape, generator=self.gen))
        folder = self.staging / f"v{version}-{id(self)}"
        self.exports[version] = self.engine.export_adapter(folder)
        return folder


def served(ctx) -> dict[str, torch.Tensor]:
    return ctx.engine.base.served_adapter(ctx.run_id)


def bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)) for k in a)


async def test_lora_runs_share_a_base_and_each_serves_its_own_adapter(redis_url, database_url, tmp_path):
    model = build_number_model(tmp_path / "model", init_std=LORA_INIT_STD)
    other = build_number_model(tmp_path / "other", init_std=LORA_INIT_STD, seed=1)
    redis.Redis.from_url(redis_url).delete(WEIGHTS)
    weights_dir = tmp_path / "weights"
    server = WeightServer(redis_url, database_url, weights_dir, keep_last=2, ANNOUNCE_PATH="false").start()
    runs = {k: insert_run(database_url, run_config(str(model), kind="train", samples_per_task=2, algorithm={"lora": lora}))
            for k, lora in ADAPTERS.items()}
    db = create_engine(database_url)
    worker = RunRegistry(db, tmp_path / "cache", 1.0)
    trainers = {k: AdapterTrainer(model, ADAPTERS[k], tmp_path / "staging", seed=i) for i, k in enumerate("ab")}
    publisher = WeightPublisher(server.url, None, timeout_s=60)
    base = BaseModelRef(name=str(model), sha256=base_model_digest(str(model)))
    stream = redis.Redis.from_url(redis_url)
    last_id = "0-0"

    async def publish(k: str, version: int, base_model: BaseModelRef = base) -> None:
        nonlocal last_id
        publisher.publish(runs[k], version, trainers[k].step_and_export(version), {}, base_model=base_model)
        entries = stream.xrange(WEIGHTS, f"({last_id}", "+")
        last_id = entries[-1][0].decode()
        for _, fields in entries:
            await worker.on_weights(decode(fields))

    try:
        ctx = {k: await worker.get(run_id) for k, run_id in runs.items()}
        assert all(isinstance(c.engine, AdapterView) for c in ctx.values())
        assert ctx["a"].engine.base is ctx["b"].engine.base is ctx["c"].engine.base  # one copy of the base
        assert len(worker.bases) == 1 and all(c.engine.version == 0 for c in ctx.values())

        for k in ("a", "b"):
            await publish(k, 1)
        assert ctx["c"].engine.version == 0
        folder = weights_dir / runs["a"] / "v1"
        manifest = json.loads((folder / MANIFEST).read_text())
        assert set(manifest["files"]) == {ADAPTER_CONFIG, ADAPTER_WEIGHTS}  # the adapter alone, PEFT's layout
        assert manifest["base_model"] == base.model_dump()
        assert json.loads((folder / ADAPTER_CONFIG).read_text())["r"] == 4
        assert bit_equal(load_file(folder / ADAPTER_WEIGHTS), trainers["a"].exports[1])
        for k in ("a", "b"):
            assert ctx[k].engine.version == 1
            assert bit_equal(served(ctx[k]), trainers[k].exports[1]), k

        await publish("a", 2)  # a new version of one run: the other keeps its adapter and version
        assert (ctx["a"].engine.version, ctx["b"].engine.version) == (2, 1)
        assert bit_equal(served(ctx["a"]), trainers["a"].exports[2])
        assert bit_equal(served(ctx["b"]), trainers["b"].exports[1])

        # one batch with both runs' requests: each gets what its adapter gives when served alone
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        prompts = [prompt_ids(tokenizer, w) for w in ("three", "seven")]

        async def ask(k: str, prompt: list[int]):
            return await ctx[k].engine.generate(prompt, GREEDY, 4)

        alone = {(k, i): await ask(k, p) for k in ("a", "b", "c") for i, p in enumerate(prompts)}
        batches_before = _batches()
        mixed = await asyncio.gather(*(ask(k, p) for k in ("a", "b", "c") for p in prompts))
        assert _batches() - batches_before == 1  # all six requests went through one generate call
        for (key, one), both in zip(alone.items(), mixed, strict=True):
            assert both.ids == one.ids, key
            assert torch.allclose(torch.tensor(both.logprobs), torch.tensor(one.logprobs), atol=1e-5), key
            assert both.weight_version == {"a": 2, "b": 1, "c": 0}[key[0]]  # its own run's adapter version
        for x, y in (("a", "b"), ("a", "c"), ("b", "c")):  # the adapters (and the bare base) answer differently
            assert any(alone[(x, i)].logprobs != alone[(y, i)].logprobs for i in range(2)), (x, y)

        # an adapter trained on another base is refused: the run keeps serving its version
        await publish("b", 2, BaseModelRef(name=str(other), sha256=base_model_digest(str(other))))
        assert ctx["b"].engine.version == 1 and bit_equal(served(ctx["b"]), trainers["b"].exports[1])
        await publish("b", 3)
        assert ctx["b"].engine.version == 3 and bit_equal(served(ctx["b"]), trainers["b"].exports[3])
        assert ctx["a"].engine.version == 2

        # a worker joining now starts every run at its newest adapter
        late = RunRegistry(db, tmp_path / "cache-late", 1.0)
        try:
            for k, v in (("a", 2), ("b", 3)):
                c = await late.get(runs[k])
                assert c.engine.version == v and bit_equal(served(c), trainers[k].exports[v])
        finally:
            await late.close()
    finally:
        server.stop()
        await worker.close()
        db.dispose()


def _batches() -> float:
    from services.rollout_worker.engines.hf import BATCH_SIZE

    return next(s.value for m in BATCH_SIZE.collect() for s in m.samples if s.name.endswith("_count"))


def test_lora_trainer_reference_checkpoint_and_optimizer_state(tmp_path):
    """The trainer's LoRA engine: only the adapter has gradients and optimizer state; the KL reference is the base
    (the adapter off), not the trained policy; a checkpoint restores the adapter and its optimizer state."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.trainer.batch import build_tensors
    from tests.support.demo import run_inprocess_parts, sample_results

    model = build_number_model(tmp_path / "model", init_std=LORA_INIT_STD)
    lora = {"rank": 4, "alpha": 8, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"]}
    learner, engine, buffer_of = run_inprocess_parts(model, 4, 8, 1e-2, lora=lora, kl_coef=0.1)
    assert engine.ref is None and engine.has_reference  # no second copy of the model
    tokenizer, base = AutoTokenizer.from_pretrained(model), AutoModelForCausalLM.from_pretrained(model).eval()
    for step in range(2):  # sampled from the base: behaviour log-probs are the base's
        groups = buffer_of(sample_results(base, tokenizer, "r", 0, step, 4, 8)).complete_groups()
        metrics = learner.step(groups, step)
    assert metrics["grad_norm"] > 0

    trainable = {n for n, p in engine.peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    optimizer = engine.actor.engine.optimizer
    with_state = [p for group in optimizer.param_groups for p in group["params"] if optimizer.state.get(p)]
    assert len(with_state) == len(trainable)  # Adam moments for the adapter only
    assert all(type(m).__name__ == "Dropout" and m.p == 0.1 for n, m in engine.peft_model.named_modules()
               if n.endswith("lora_dropout.default"))

    t = build_tensors(groups, tokenizer.pad_token_id)
    mask = t["response_mask"].bool()
    reference, current = engine.log_probs(t, reference=True)[0], engine.log_probs(t)[0]
    assert torch.allclose(reference[mask], t["behaviour_log_probs"][mask], atol=1e-5)  # the base's
    assert not torch.allclose(current[mask], t["behaviour_log_probs"][mask], atol=1e-3)  # the adapter moved it

    engine.save(tmp_path / "ckpt", 2)
    exported = engine.export_adapter(tmp_path / "a")
    _, resumed, _ = run_inprocess_parts(model, 4, 8, 1e-2, lora=lora, kl_coef=0.1)
    assert not bit_equal(resumed.export_adapter(tmp_path / "b"), exported)
    resumed.load(tmp_path / "ckpt")
    assert bit_equal(resumed.export_adapter(tmp_path / "c"), exported)
    moments = [optimizer.state[p]["exp_avg"] for p in with_state]
    restored = resumed.actor.engine.optimizer
    again = [restored.state[p]["exp_avg"] for g in restored.param_groups for p in g["params"] if restored.state.get(p)]
    assert len(again) == len(moments)
    assert all(torch.equal(_local(a), _local(b)) for a, b in zip(again, moments, strict=True))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def make_adapter(model: Path, folder: Path, seed: int) -> Path:
    """A PEFT adapter (rank 8, q_proj/v_proj) with random A and B, saved as a trainer's export is."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(model),
                          LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    peft.save_pretrained(folder)
    return folder


def hf_greedy(model: Path, adapter: Path | None, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model)
    m = (PeftModel.from_pretrained(m, adapter) if adapter else m).eval()
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logp = torch.log_softmax(m(torch.tensor([ids])).logits[0, -1].float(), -1)
            tok = int(logp.argmax())
            ids.append(tok)
            logprobs.append(float(logp[tok]))
    return ids[len(prompt):], logprobs


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_vllm_serves_each_runs_adapter_in_mixed_batches(tmp_path):
    """vLLM in process (`LoRARequest`): three runs' adapters and a run without one on one base, max_loras=2 (an
    adapter is evicted and reloaded on the way); each run's greedy tokens and logprobs, alone and all in one
    batch, are those of its adapter in HF/PEFT; a new version of one run changes only its answers; an adapter of
    another base is refused."""
    import subprocess

    from fixtures.vllm_env import vllm_env, vllm_python

    from tests.support.tiny_model import build_vllm_tiny_model

    py = vllm_python()
    model = build_vllm_tiny_model(tmp_path / "model", seed=0)
    other = build_vllm_tiny_model(tmp_path / "other", seed=1)
    adapters = {"a": {"1": make_adapter(model, tmp_path / "a1", 1), "2": make_adapter(model, tmp_path / "a2", 2)},
                "b": {"1": make_adapter(model, tmp_path / "b1", 3)}, "c": {"1": make_adapter(model, tmp_path / "c1", 4)}}
    prompts, n = [[5, 6, 7, 8], [40, 41, 42]], 6
    spec = {"model": str(model), "prompts": prompts, "max_tokens": n,
            "adapters": {r: {v: str(f) for v, f in vs.items()} for r, vs in adapters.items()},
            "base": {"name": str(model), "sha256": base_model_digest(str(model))},
            "other_base": {"name": str(other), "sha256": base_model_digest(str(other))}}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run([py, "tests/fixtures/vllm_lora_check.py", str(tmp_path / "spec.json")],
                          cwd=Path(__file__).resolve().parents[2], env=vllm_env(), capture_output=True, text=True,
                          timeout=540)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("@@")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(lines[-1][2:])

    def expected(run: str, version: int, prompt: list[int]):
        folder = adapters[run][str(version)] if run != "bare" else None
        return hf_greedy(model, folder, prompt, n)

    for phase, versions in (("alone", {"a": 1}), ("mixed", {"a": 1}), ("after", {"a": 2})):
        for r in out[phase]:
            version = versions.get(r["run"], 0 if r["run"] == "bare" else 1)
            ids, logprobs = expected(r["run"], version, prompts[out[phase].index(r) % len(prompts)])
            assert r["ids"] == ids, (phase, r["run"])
            assert r["logprobs"] == pytest.approx(logprobs, abs=1e-4), (phase, r["run"])
            assert r["version"] == version, (phase, r["run"])
    answers = {(r["run"], i % 2): r["ids"] for i, r in enumerate(out["alone"])}
    assert len({tuple(v) for k, v in answers.items() if k[1] == 0}) == 4  # every adapter (and none) differs
    assert "belongs to base model" in out["other_base"]


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_a_vllm_server_serves_each_runs_adapter_through_the_openai_engine(tmp_path):
    """The openai engine against a real vLLM server (`.venv-vllm`, --enable-lora, max_loras 2): three runs'
    adapters and a run without one, alone and all in one go, give each run its adapter's HF/PEFT greedy tokens and
    logprobs under its own version; a new version of one run changes only its answers and the old name is
    unloaded; an adapter of another base is refused; a restarted worker loads its names again in place."""
    import httpx
    from fixtures.vllm_env import start_vllm_server

    from infra.local.ports import free_port
    from services.rollout_worker.engines import build_engine
    from shared.contracts.run_config import EngineConfig
    from shared.weights.manifest import ChecksumError
    from tests.support.tiny_model import build_vllm_tiny_model

    model = build_vllm_tiny_model(tmp_path / "model", seed=0)
    other = build_vllm_tiny_model(tmp_path / "other", seed=1)
    adapters = {("a", 1): make_adapter(model, tmp_path / "a1", 1), ("a", 2): make_adapter(model, tmp_path / "a2", 2),
                ("b", 1): make_adapter(model, tmp_path / "b1", 3), ("c", 1): make_adapter(model, tmp_path / "c1", 4)}
    base_ref = BaseModelRef(name=str(model), sha256=base_model_digest(str(model)))
    prompts, n = [[5, 6, 7, 8], [40, 41, 42]], 6
    port = free_port()
    proc = start_vllm_server(model, port, tmp_path / "server.log", lora={"max_loras": 2, "max_lora_rank": 8})
    url = f"http://127.0.0.1:{port}"
    cfg = EngineConfig(type="openai", base_url=f"{url}/v1", max_retries=1)
    engines, expected = [], {}

    def connect():
        engines.append(build_engine("openai", str(model), cfg, tokenizer=None, scratch_dir=tmp_path / "scratch"))
        return {run: AdapterView(engines[-1], run) for run in ("a", "b", "c", "bare")}

    async def answers(views, versions: dict[str, int], together: bool) -> None:
        asks = [(run, p) for run in views for p in prompts]
        calls = [views[run].generate(p, GREEDY, n) for run, p in asks]
        got = await asyncio.gather(*calls) if together else [await c for c in calls]
        for (run, prompt), gen in zip(asks, got, strict=True):
            version = versions.get(run, 0)
            key = (run if version else "bare", version, tuple(prompt))
            if key not in expected:
                expected[key] = hf_greedy(model, adapters.get((run, version)), prompt, n)
            ids, logprobs = expected[key]
            assert gen.ids == ids, (run, prompt, together)
            assert gen.logprobs == pytest.approx(logprobs, abs=1e-4), (run, prompt)
            assert gen.weight_version == version, (run, prompt)

    def served_names() -> set[str]:
        return {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]}

    try:
        views = connect()
        for run in "abc":
            await views[run].load_adapter(adapters[(run, 1)], 1, base_ref)
        versions = {"a": 1, "b": 1, "c": 1}
        await answers(views, versions, together=False)
        await answers(views, versions, together=True)
        await views["a"].load_adapter(adapters[("a", 2)], 2, base_ref)
        versions["a"] = 2
        await answers(views, versions, together=True)
        assert "a-v2" in served_names() and "a-v1" not in served_names()  # unloaded: no request used it any more
        with pytest.raises(ChecksumError, match="belongs to base model"):
            await views["b"].load_adapter(adapters[("a", 2)], 2,
                                          BaseModelRef(name=str(other), sha256=base_model_digest(str(other))))
        assert views["b"].version == 1

        restarted = connect()  # a new worker on the same server: the names it loads exist there already
        for run, version in versions.items():
            await restarted[run].load_adapter(adapters[(run, version)], version, base_ref)
        await answers(restarted, versions, together=True)
    finally:
        for engine in engines:
            await engine.close()
        proc.terminate()
        try:
            proc.wait(30)
        except Exception:
            proc.kill()


def test_lora_runs_over_one_base_share_one_trainer_engine_and_train_as_if_alone(tmp_path):
    """Two LoRA runs of one kind on one trainer engine (services/trainer/lora_shared_engine.py): one copy of the base,
    and the steps of each, interleaved, give bit for bit the adapter that run gets on an engine of its own: its
    adapter, Adam moments and schedule never leak into the other's. A checkpoint written while the other run was
    swapped in restores that run's state into a new engine."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.trainer.batch import GroupBuffer, samples_from_result
    from services.trainer.engine import PolicyEngine
    from services.trainer.learner import Learner
    from services.trainer.lora_shared_engine import close_engine, engines_held, open_engine
    from tests.support.demo import ALGORITHM, sample_results

    model = build_number_model(tmp_path / "model", init_std=LORA_INIT_STD)
    algo = AlgorithmConfig.model_validate(ALGORITHM | {"lr": 1e-2, "lora": {"rank": 4, "alpha": 8,
                                                                           "target_modules": ["q_proj", "v_proj"]}})
    tokenizer, base = AutoTokenizer.from_pretrained(model), AutoModelForCausalLM.from_pretrained(model).eval()
    torch.manual_seed(0)
    batches = {run: [sample_results(base, tokenizer, run, 0, step, 4, 8) for step in range(3)] for run in "ab"}

    def step(engine, run: str, k: int) -> None:
        buffer = GroupBuffer(8, need_greedy=False)
        for result in batches[run][k]:
            for s in samples_from_result(result):
                buffer.add(s)
        Learner(engine, algo, tokenizer.pad_token_id).step(buffer.complete_groups(), k)

    def build(run: str | None = None):
        # the same fresh adapter (verl draws LoRA A at random) for every engine: open_engine seeds with the run's
        # seed just before it builds, the engine of its own is built under the same seed
        options = {"group_size": 8, "micro_batch_size": 32, "lr_warmup_steps": 3}  # a schedule per run
        if run:
            return open_engine(run, str(model), algo, seed=1, **options)
        torch.manual_seed(1)
        return PolicyEngine(str(model), algo, **options)

    alone = {}
    for run in "ab":
        engine = build()
        for k in range(3):
            step(engine, run, k)
        alone[run] = engine.export_adapter(tmp_path / f"alone-{run}")
        del engine

    a, b = build("a"), build("b")
    assert a.shared is b.shared and engines_held() == 1  # one copy of the base for both runs
    for k in range(2):
        step(a, "a", k)
        step(b, "b", k)
    a.save(tmp_path / "ckpt-a", 2)  # b was swapped in last: this writes a's state
    step(b, "b", 2)
    step(a, "a", 2)
    assert bit_equal(a.export_adapter(tmp_path / "shared-a"), alone["a"])
    assert bit_equal(b.export_adapter(tmp_path / "shared-b"), alone["b"])
    assert not bit_equal(alone["a"], alone["b"])

    close_engine("a")
    close_engine("b")
    assert engines_held() == 0
    resumed, other = build("a"), build("c")
    step(other, "b", 0)  # another run swapped in before the load
    resumed.load(tmp_path / "ckpt-a")
    step(resumed, "a", 2)
    assert bit_equal(resumed.export_adapter(tmp_path / "resumed-a"), alone["a"])
    close_engine("a")
    close_engine("c")
