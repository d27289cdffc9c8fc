"""A served network as numpy arrays: the CTR of a few events without torch's per-operation cost.

A request scores 1 to 64 events. At that size CtrModel's forward is bound by the framework, not
the arithmetic: ~25 torch operations at 4-8 us each around two (K, K) matrix-vector products
(K = F*E + D = 637 for Criteo's DCN), ~400 us for one event where the products take ~50 us.
The same forward in numpy costs ~1-2 us an operation. `score` is that forward for every family
(trainer/model.py's, read from its weights by `scorer_of`, so nothing is configured twice), pinned
to trainer.step.predict by tests/test_serving_scorer.py (every family, FNC, list fields: |diff| < 1e-6).

    rows  float32 (B, F, W): each field's row, W = E + 1 (or 1 when the family reads no factors)
    dense float32 (B, D)
    -> CTR float32 (B,)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from trainer.model import CtrModel, OnlineNorm


@dataclass(frozen=True, eq=False)
class Scorer:
    """The weights of one CtrModel, float32, laid out for `x @ w` (weights transposed once here)."""

    embed_dim: int  # E
    reads_factors: bool  # False: rows are (B, F, 1), the first-order weights alone (lr)
    fm: bool  # + FM's pairwise interactions
    fnc: bool  # the served CTR is b / (1 - b) (delayed_feedback "fnc")
    bias: np.float32  # the global bias
    norm: tuple[np.ndarray, np.ndarray] | None  # dense standardization: (mean (D,), 1 / sqrt(var + eps) (D,))
    dense_weight: np.ndarray  # (D,) the dense features' linear weights
    # cross layers: ((K, K) transposed weight, or the low-rank pair (K, r) and (r, K), then the bias (K,))
    cross: tuple[tuple[tuple[np.ndarray, ...], np.ndarray], ...]
    mlp: tuple[tuple[np.ndarray, np.ndarray], ...]  # (in, out) transposed weights and (out,) biases; ReLU between


def _np(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().cpu().numpy(), dtype=np.float32)


def scorer_of(model: CtrModel) -> Scorer:
    """The numpy form of a CtrModel (read once per published model)."""
    norm = None
    if isinstance(model.norm, OnlineNorm):
        mean, var, eps = model.norm.mean, model.norm.var, model.norm.eps
        norm = (_np(mean), _np(1.0 / torch.sqrt(var + eps)))
    cross: list[tuple[tuple[np.ndarray, ...], np.ndarray]] = []
    for layer in getattr(model, "cross", ()):
        linears = [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]  # W, or U then V (low rank)
        cross.append((tuple(_np(lin.weight.T) for lin in linears), _np(linears[-1].bias)))
    mlp = tuple(
        (_np(lin.weight.T), _np(lin.bias)) for lin in getattr(model, "mlp", ()) if isinstance(lin, torch.nn.Linear)
    )
    return Scorer(
        embed_dim=model.config.embed_dim,
        reads_factors=model.reads_factors,
        fm=model.family.fm,
        fnc=model.config.delayed_feedback == "fnc",
        bias=np.float32(model.bias.item()),
        norm=norm,
        dense_weight=_np(model.dense_linear.weight.reshape(-1)),  # type: ignore[operator]
        cross=tuple(cross),
        mlp=mlp,
    )


def score(scorer: Scorer, rows: np.ndarray, dense: np.ndarray) -> np.ndarray:
    """CTR (B,) of rows (B, F, W) and dense (B, D): CtrModel.forward, then its served probability."""
    first = rows[:, :, -1]  # (B, F)
    if scorer.norm is not None:
        dense = (dense - scorer.norm[0]) * scorer.norm[1]
    logit = scorer.bias + first.sum(axis=1) + dense @ scorer.dense_weight
    if scorer.reads_factors:
        factors = rows[:, :, : scorer.embed_dim]  # (B, F, E)
        if scorer.fm:
            summed = factors.sum(axis=1)
            logit = logit + 0.5 * (summed * summed - (factors * factors).sum(axis=1)).sum(axis=1)
        if scorer.mlp:
            x0 = np.concatenate([factors.reshape(len(rows), -1), dense], axis=1)  # (B, F*E + D)
            x = x0
            for weights, bias in scorer.cross:
                wx = x
                for w in weights:
                    wx = wx @ w
                x = x0 * (wx + bias) + x
            for i, (w, b) in enumerate(scorer.mlp):
                x = x @ w + b
                if i < len(scorer.mlp) - 1:
                    np.maximum(x, 0.0, out=x)
            logit = logit + x[:, 0]
    with np.errstate(over="ignore"):  # exp(88.8+) is inf in float32: the CTR is 0, as torch's sigmoid rounds it
        p = 1.0 / (1.0 + np.exp(-logit.astype(np.float32)))
    if scorer.fnc:
        p = np.clip(p / np.maximum(1.0 - p, 1e-7), 0.0, 1.0)
    return p.astype(np.float32, copy=False)
