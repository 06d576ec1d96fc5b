"""Dev/test helpers for the megatron-core integration: a tiny GPT config, a fixed batch, one
training step and an eval loss through megatron's own pipeline schedule (any TP/PP/DP).

The eval loss is a plain cross entropy over the *true* vocabulary of the TP-gathered logits, so it
does not depend on how many padding rows the TP degree adds.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..integrations.megatron.specs import GPTSpecConfig


def tiny_gpt_config(num_layers: int = 4, vocab_size: int = 120) -> GPTSpecConfig:
    """GQA (8 heads, 4 query groups), gated MLP (swiglu), biases, learned positions, fp32."""
    return GPTSpecConfig(num_layers=num_layers, hidden_size=32, num_attention_heads=8, num_query_groups=4,
                         vocab_size=vocab_size, ffn_hidden_size=48, gated_linear_unit=True, add_bias_linear=True,
                         make_vocab_size_divisible_by=8, max_sequence_length=16)


def fixed_batch(cfg: GPTSpecConfig, micro_batches: int = 2, mbs: int = 2, seq: int = 16, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, cfg.vocab_size, (micro_batches, mbs, seq + 1), generator=g)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in toks]


def _run(model: Any, cfg: GPTSpecConfig, batch, forward_only: bool) -> Optional[float]:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    mbs, seq = batch[0][0].shape
    it = iter(batch)
    pos = torch.arange(seq).unsqueeze(0).expand(mbs, seq)
    mask = torch.tril(torch.ones(seq, seq, dtype=torch.bool)).logical_not().view(1, 1, seq, seq)

    def forward_step(data_iterator, m):
        tokens, labels = next(data_iterator)
        out = m(tokens, pos, mask)

        def loss_func(output):
            logits = output  # [b, s, padded vocab], TP-gathered (parallel_output=False)
            logits = logits[..., :cfg.vocab_size].float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), labels.reshape(-1))
            return loss, {"loss": loss.detach().clone()}
        return out, loss_func

    losses = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=it, model=[model],
                                         num_microbatches=len(batch), seq_length=seq, micro_batch_size=mbs,
                                         forward_only=forward_only)
    if not ps.is_pipeline_last_stage():
        return None
    return float(torch.stack([d["loss"] for d in losses]).mean())


def eval_loss(model: Any, cfg: GPTSpecConfig, batch) -> float:
    """Mean loss over the micro-batches, identical on every rank (collective over the world)."""
    import torch.distributed as dist

    model.eval()
    with torch.no_grad():
        local = _run(model, cfg, batch, forward_only=True)
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, local)
    vals = [v for v in got if v is not None]
    return vals[0]


def train_step(model: Any, cfg: GPTSpecConfig, batch, optimizer: torch.optim.Optimizer) -> None:
    """One forward/backward through the schedule and an optimizer step (DP = 1: no grad all-reduce)."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    _run(model, cfg, batch, forward_only=False)
    optimizer.step()


def consolidated_differences(a: str, b: str) -> list[str]:
    """Tensors that differ between two consolidated checkpoint directories (empty: bit-identical)."""
    import os

    from safetensors.torch import load_file

    bad = []
    for f in ("model.safetensors", "optimizer.safetensors"):
        x, y = load_file(os.path.join(a, f)), load_file(os.path.join(b, f))
        if set(x) != set(y):
            bad.append(f"{f}: names differ {sorted(set(x) ^ set(y))[:4]}")
        bad += [f"{f}:{k}" for k in x if k in y and not torch.equal(x[k], y[k])]
    return bad
