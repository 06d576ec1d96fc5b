"""A tiny deterministic pipeline model and data stream for DeepSpeed tests and the bench (pure torch).

Layers (the pipeline's layer list): token embedding, ``num_blocks`` pre-norm MLP blocks, a head
(norm + vocab projection). ``batches`` yields the micro-batches one DP rank consumes, with samples
chosen by global index so that any (DP, gradient accumulation) split of the same global batch sees
the same samples.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn


class Embed(nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids)


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Head(nn.Module):
    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def layers(vocab: int = 64, hidden: int = 32, num_blocks: int = 6) -> list[nn.Module]:
    """Layer *factories* are not needed: build each layer under a seed derived from its index so
    that the initial weights do not depend on the partition."""
    out: list[nn.Module] = []
    for i in range(num_blocks + 2):
        torch.manual_seed(1000 + i)
        if i == 0:
            out.append(Embed(vocab, hidden))
        elif i == num_blocks + 1:
            out.append(Head(hidden, vocab))
        else:
            out.append(Block(hidden))
    return out


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def sample(index: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(index)
    ids = torch.randint(0, vocab, (seq + 1,), generator=g)
    return ids[:-1], ids[1:]


def batches(start_step: int, dp_rank: int, dp: int, gas: int, micro: int, seq: int = 16,
            vocab: int = 64) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Micro-batches of DP rank ``dp_rank`` from optimizer step ``start_step`` on (global batch =
    ``micro * gas * dp`` samples per step; replica ``d`` takes micro-batches ``d*gas .. d*gas+gas-1``)."""
    step = start_step
    gbs = micro * gas * dp
    while True:
        for m in range(gas):
            base = step * gbs + (dp_rank * gas + m) * micro
            xs, ys = zip(*(sample(base + j, seq, vocab) for j in range(micro)))
            yield torch.stack(xs), torch.stack(ys)
        step += 1
