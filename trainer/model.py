"""The model families behind one trainer: LR, FM, DeepFM and DCN-v2, chosen by `ModelConfig.kind`.

Every family reads the same inputs, so the store, merge, snapshot and serving paths do not care
which one runs. Per batch of B events, F sparse fields, D dense floats, embedding width E:
  rows  (B, F, E + 1): each field's row from the store: E factor values + 1 first-order weight
  dense (B, D)
Output: logits (B,). The embedding rows live in the store, not in these modules, so the dense
part here is what replicas average and what a snapshot's dense.safetensors holds.

All families share the wide part: bias + sum of the fields' first-order weights + a linear term
over the (online-normalized) dense features. On top of it:
  lr      nothing (logistic regression over one-hot ids and dense floats)
  fm      + pairwise factor interactions, 0.5 * (|sum v|^2 - sum |v|^2)     (Rendle, 2010)
  deepfm  + fm + an MLP over [factors, dense]                               (Guo et al., 2017)
  dcn     + cross layers x_{l+1} = x0 * (W x_l + b) + x_l, then an MLP      (Wang et al., DCN-v2, 2021)
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass

import torch
from torch import nn

from common.checks import check_fields, one_of
from trainer.errors import TrainerError


@dataclass(frozen=True)
class Family:
    """What a model family adds to the shared wide part, and what its defaults are. A new family
    is one entry in FAMILIES (a missing field is an error at import)."""

    fm: bool  # + FM's pairwise factor interactions
    cross: bool  # + DCN-v2's cross layers in front of the MLP
    mlp: bool  # + an MLP over [factors, dense]
    # what trainer.model.embed_dim = 0 and trainer.optim.sparse_lr = 0 mean: the factor width and
    # the factors' rate at batch 256 (trainer/settings.py scales it with the batch), tuned on the
    # synthetic stream and the first half of the real rows. DCN's cross layers use wide factors
    # well; the FM term's size grows with the width and rate, so FM-based families stay narrow.
    embed_dim: int
    sparse_lr: float

    def __post_init__(self) -> None:
        if self.cross and not self.mlp:
            raise TrainerError(f"model family {self}: cross layers feed an MLP; set mlp=True")


FAMILIES: dict[str, Family] = {
    "lr": Family(fm=False, cross=False, mlp=False, embed_dim=8, sparse_lr=0.05),
    "fm": Family(fm=True, cross=False, mlp=False, embed_dim=8, sparse_lr=0.05),
    "deepfm": Family(fm=True, cross=False, mlp=True, embed_dim=8, sparse_lr=0.05),
    "dcn": Family(fm=False, cross=True, mlp=True, embed_dim=16, sparse_lr=0.15),
}
MODEL_KINDS = tuple(FAMILIES)
DELAYED_FEEDBACK = ("none", "fnw", "fnc")  # trainer.optim.delayed_feedback: final labels, FN weighting, FN calibration


@dataclass(frozen=True)
class ModelConfig:
    num_fields: int  # F: fields per event the model sees (single-id fields, then one per pooled list field)
    num_dense: int  # D: dense floats per event
    embed_dim: int = 8  # E: factor width; store rows are E + 1 wide (factor + linear weight)
    hidden: tuple[int, ...] = (128, 64)  # MLP layer widths (deepfm, dcn)
    seed: int = 0  # seed of the dense initialization
    kind: str = one_of(MODEL_KINDS, "dcn")  # the family (the default: trainer.model.kind's)
    cross_layers: int = 2  # cross layers (dcn)
    cross_rank: int = 0  # 0: full-rank cross weights (F*E + D)^2; r > 0: W = U V^T of rank r (cheaper)
    dense_norm: bool = True  # standardize dense features by running mean / variance
    list_pooling: tuple[str, ...] = ()  # per list field (the last fields): "mean" or "sum" of its values' rows
    # labels that come late (trainer/delayed.py): "fnw" weights the loss, "fnc" serves b / (1 - b); "none"
    delayed_feedback: str = one_of(DELAYED_FEEDBACK, "none")

    def __post_init__(self) -> None:
        check_fields(self, "ModelConfig", TrainerError)

    @property
    def row_dim(self) -> int:
        return self.embed_dim + 1

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ModelConfig:
        data = dict(data)
        data["hidden"] = tuple(data["hidden"])  # type: ignore[arg-type]
        data["list_pooling"] = tuple(data.get("list_pooling", ()))  # type: ignore[arg-type]
        return cls(**data)  # type: ignore[arg-type]


class OnlineNorm(nn.Module):
    """Dense features standardized by their running mean and variance, (B, D) -> (B, D).

    In training mode a batch is normalized with the statistics of the batches before it, then
    folded into them (so a batch's scores never depend on its own values). The count is capped so
    that the statistics keep following a drifting stream. The buffers are part of the model:
    snapshots hold them and replica merges average them.
    """

    count: torch.Tensor  # () events folded in (capped)
    mean: torch.Tensor  # (D,)
    var: torch.Tensor  # (D,)

    def __init__(self, width: int, cap: float = 1e6, eps: float = 1e-5) -> None:
        super().__init__()
        self.cap, self.eps = cap, eps
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("mean", torch.zeros(width))
        self.register_buffer("var", torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = (x - self.mean) / torch.sqrt(self.var + self.eps)
        if self.training and x.numel():  # (an event stream with no dense fields has nothing to follow)
            with torch.no_grad():
                n = float(len(x))
                batch_mean = x.mean(dim=0)
                batch_var = x.var(dim=0, unbiased=False)
                total = self.count + n
                delta = batch_mean - self.mean
                # Chan et al.'s pairwise combination; before any data the prior is mean 0, var 1
                old_var = torch.where(self.count > 0, self.var, torch.zeros_like(self.var))
                self.mean += delta * (n / total)
                self.var.copy_((old_var * self.count + batch_var * n + delta * delta * self.count * n / total) / total)
                self.count.copy_(torch.clamp(total, max=self.cap))
        return out


def _mlp(width: int, hidden: tuple[int, ...]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    out = nn.Linear(width, 1)
    # the deep part starts at exactly zero, so a fresh model is its wide part (plus FM) and the MLP
    # adds to it only what it learns; a random head would add noise to every early prediction
    nn.init.zeros_(out.weight)
    nn.init.zeros_(out.bias)
    layers.append(out)
    return nn.Sequential(*layers)


def _cross_layer(width: int, rank: int) -> nn.Module:
    """x -> W x + b, W (width, width) full or, with rank > 0, U V^T (DCN-v2's low-rank cross)."""
    out = nn.Linear(width if rank <= 0 else rank, width)
    nn.init.zeros_(out.bias)
    layer: nn.Module = out if rank <= 0 else nn.Sequential(nn.Linear(width, rank, bias=False), out)
    return layer


class CtrModel(nn.Module):
    """One module for every family (the parts a family does not use are not built)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(config.seed)
        self.bias = nn.Parameter(torch.zeros(1))
        self.norm = OnlineNorm(config.num_dense) if config.dense_norm else nn.Identity()
        with warnings.catch_warnings():  # a schema with no dense fields (avazu): a (1, 0) weight, nothing to init
            warnings.filterwarnings("ignore", "Initializing zero-element tensors", UserWarning)
            self.dense_linear = nn.Linear(config.num_dense, 1, bias=False)
        width = config.num_fields * config.embed_dim + config.num_dense
        self.family = FAMILIES[config.kind]
        if self.family.cross:
            self.cross = nn.ModuleList(_cross_layer(width, config.cross_rank) for _ in range(config.cross_layers))
        if self.family.mlp:
            self.mlp = _mlp(width, config.hidden)
        torch.random.set_rng_state(generator_state)

    @property
    def reads_factors(self) -> bool:
        """Whether forward reads the rows' factor columns (every family but lr); without them it
        takes rows of width 1, the first-order weights alone."""
        return self.family.fm or self.family.mlp

    def forward(self, rows: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """rows (B, F, E+1), or (B, F, 1) when not reads_factors; dense (B, D) -> logits (B,)."""
        family, e = self.family, self.config.embed_dim
        factors, first = rows[..., :e], rows[..., -1]  # (B, F, E), (B, F)
        dense = self.norm(dense)
        logit = self.bias + first.sum(dim=1) + self.dense_linear(dense).squeeze(1)
        if family.fm:
            summed = factors.sum(dim=1)
            logit = logit + 0.5 * (summed * summed - (factors * factors).sum(dim=1)).sum(dim=1)
        if not family.mlp:
            return logit
        x0 = torch.cat([factors.flatten(1), dense], dim=1)  # (B, F*E + D)
        x = x0
        if family.cross:
            for layer in self.cross:
                x = x0 * layer(x) + x
        return logit + self.mlp(x).squeeze(1)
