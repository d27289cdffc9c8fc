"""DeepFM over per-field embeddings: FM (first + second order) plus an MLP over the fields and dense features.

Inputs per batch of B events, F sparse fields, D dense floats, embedding width E:
  rows  (B, F, E + 1): each field's row from the store: E factor values + 1 first-order weight
  dense (B, D)
Output: logits (B,). The embedding rows live in the store, not in this module, so the dense part
here is what data-parallel trainers average and what a snapshot's dense.safetensors holds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    num_fields: int  # F: sparse fields per event
    num_dense: int  # D: dense floats per event
    embed_dim: int = 8  # E: factor width; store rows are E + 1 wide (factor + linear weight)
    hidden: tuple[int, ...] = (128, 64)  # MLP layer widths
    seed: int = 0  # seed of the dense initialization

    @property
    def row_dim(self) -> int:
        return self.embed_dim + 1

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ModelConfig:
        data = dict(data)
        data["hidden"] = tuple(data["hidden"])  # type: ignore[arg-type]
        return cls(**data)  # type: ignore[arg-type]


class DeepFM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(config.seed)
        self.bias = nn.Parameter(torch.zeros(1))
        self.dense_linear = nn.Linear(config.num_dense, 1, bias=False)
        layers: list[nn.Module] = []
        width = config.num_fields * config.embed_dim + config.num_dense
        for h in config.hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)
        torch.random.set_rng_state(generator_state)

    def forward(self, rows: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        e = self.config.embed_dim
        factors, first = rows[..., :e], rows[..., e]  # (B, F, E), (B, F)
        summed = factors.sum(dim=1)
        second = 0.5 * (summed * summed - (factors * factors).sum(dim=1)).sum(dim=1)  # (B,)
        deep = self.mlp(torch.cat([factors.flatten(1), dense], dim=1)).squeeze(1)
        return self.bias + first.sum(dim=1) + self.dense_linear(dense).squeeze(1) + second + deep
