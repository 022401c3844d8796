"""Per-token log-probs and entropy over the vocabulary without fp32 logits (the trainer's `chunked_triton`).

verl's chunked torch kernel (verl.utils.experimental.torch_functional) computes each 512-token chunk's logits
with one matmul, then upcasts them to fp32 and takes softmax, log-softmax, entropy and their gradient in about a
dozen passes over [chunk, vocabulary] fp32 tensors: on a 152k vocabulary that was most of a 0.5B model's step.
Here the chunking and the matmuls stay verl's; the vocabulary math is two Triton kernels over the chunk's bf16
logits: forward reads them once (online log-sum-exp and mean logit), backward reads them once more and writes
the gradient in their place. `use(True)` routes verl's per-chunk functions here; CPU tensors keep verl's.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: verl's own chunk functions serve
    triton = None

BLOCK = 4096  # vocabulary entries a program reads per step


if triton is not None:

    @triton.jit
    def _row_stats_kernel(logits, stride, targets, inv_t, logprob, entropy, lse_out, mean_out, V: tl.constexpr,
                          BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * stride
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)  # sum of exp(x - m)
        w = tl.zeros((), tl.float32)  # sum of exp(x - m) * x
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inside = offs < V
            x = tl.load(base + offs, mask=inside, other=float("-inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m, tl.max(x, 0))
            e = tl.exp(x - m_new)
            scale = tl.exp(m - m_new)
            s = s * scale + tl.sum(e, 0)
            w = w * scale + tl.sum(tl.where(inside, e * x, 0.0), 0)
            m = m_new
        lse = m + tl.log(s)
        mean = w / s
        target = tl.load(targets + row)
        x_t = tl.load(base + target).to(tl.float32) * inv_t
        tl.store(logprob + row, x_t - lse)
        tl.store(entropy + row, lse - mean)
        tl.store(lse_out + row, lse)
        tl.store(mean_out + row, mean)

    @triton.jit
    def _grad_kernel(logits, stride, targets, inv_t, lse_in, mean_in, dlogprob, dentropy, V: tl.constexpr,
                     HAS_DLP: tl.constexpr, HAS_DENT: tl.constexpr, BLOCK: tl.constexpr):
        # d logprob_t / dx_j = [j == t] - p_j; d entropy / dx_j = p_j (mean - x_j); x = logits / T
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * stride
        lse = tl.load(lse_in + row)
        mean = tl.load(mean_in + row)
        g_lp = tl.zeros((), tl.float32)
        g_h = tl.zeros((), tl.float32)
        if HAS_DLP:
            g_lp = tl.load(dlogprob + row).to(tl.float32)
        if HAS_DENT:
            g_h = tl.load(dentropy + row).to(tl.float32)
        target = tl.load(targets + row)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inside = offs < V
            x = tl.load(base + offs, mask=inside, other=0.0).to(tl.float32) * inv_t
            p = tl.exp(x - lse)
            d = g_h * p * (mean - x) - g_lp * p
            d = tl.where(offs == target, d + g_lp, d) * inv_t
            tl.store(base + offs, d.to(base.dtype.element_ty), mask=inside)


def row_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, ...]:
    """log p(target), entropy, log-sum-exp and mean of logits / temperature, per row (fp32), one read of `logits`."""
    rows, vocab = logits.shape
    out = [torch.empty(rows, device=logits.device, dtype=torch.float32) for _ in range(4)]
    if rows:
        _row_stats_kernel[(rows,)](logits, logits.stride(0), targets, 1.0 / temperature, *out, vocab, BLOCK=BLOCK, num_warps=8)
    return tuple(out)


def _chunk_fwd(hidden_states, vocab_weights, input_ids, temperature=1.0):
    if not _on_triton(hidden_states):
        return _verl_fwd(hidden_states, vocab_weights, input_ids, temperature)
    logits = hidden_states @ vocab_weights.t()
    logprob, entropy, _, _ = row_stats(logits, input_ids.contiguous(), temperature)
    return logprob, entropy.to(logits.dtype)


def _chunk_bwd(dlog_probs, dentropy, hidden_states, vocab_weights, input_ids, temperature=1.0):
    if not _on_triton(hidden_states):
        return _verl_bwd(dlog_probs, dentropy, hidden_states, vocab_weights, input_ids, temperature)
    logits = hidden_states @ vocab_weights.t()
    targets = input_ids.contiguous()
    _, _, lse, mean = row_stats(logits, targets, temperature)
    rows, vocab = logits.shape
    if rows:
        _grad_kernel[(rows,)](logits, logits.stride(0), targets, 1.0 / temperature, lse, mean,
                              dlog_probs.contiguous() if dlog_probs is not None else lse,
                              dentropy.contiguous() if dentropy is not None else lse, vocab,
                              HAS_DLP=dlog_probs is not None, HAS_DENT=dentropy is not None, BLOCK=BLOCK,
                              num_warps=8)
    return logits @ vocab_weights, logits.t() @ hidden_states  # logits now hold d loss / d logits


def _on_triton(t: torch.Tensor) -> bool:
    # TRITON_INTERPRET=1: Triton's interpreter runs the kernels on CPU tensors (the CPU tests)
    return _enabled and triton is not None and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


_enabled = False
_verl_fwd = _verl_bwd = None


def use(enabled: bool) -> None:
    """Route verl's chunk functions here (True) or back to verl's own (False), for the whole process: verl looks
    them up at each call, so the engine built last decides (one kind of engine per trainer process)."""
    global _enabled, _verl_fwd, _verl_bwd
    from verl.utils.experimental import torch_functional as verl_chunks

    if _verl_fwd is None:
        _verl_fwd, _verl_bwd = verl_chunks._fused_linear_for_ppo_fwd, verl_chunks._fused_linear_for_ppo_bwd
        verl_chunks._fused_linear_for_ppo_fwd, verl_chunks._fused_linear_for_ppo_bwd = _chunk_fwd, _chunk_bwd
    _enabled = enabled
