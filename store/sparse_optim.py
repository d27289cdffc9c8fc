"""Per-row optimizers for embedding rows: pure functions over (rows, grad) -> new rows.

A row is 3 * dim float32 values, [vector | state_a | state_b]; the optimizer's state lives in the
row, so it travels with it through every tier, every merge (averaged like the vector) and every
snapshot. What the two state blocks hold:

    adagrad   [w | sum of squared gradients | unused (zeros)]
    ftrl      [w | z (FTRL-Proximal's shifted gradient sum) | n (sum of squared gradients)]
    adam      [w | exp_avg | exp_avg_sq]     (lazy, like torch.optim.SparseAdam)
    sgd       [w | unused | unused]          (for equivalence tests)

`grad` (u, dim) is the gradient of the batch's *summed* loss w.r.t. each touched row (an id seen
c times in the batch sums c per-event gradients). Adagrad and FTRL are per-coordinate adaptive:
a rare id gets a full step on its first sighting, a frequent one ever smaller steps, the classic
recipe for sparse online CTR models (McMahan et al., "Ad Click Prediction", KDD 2013).

The last column of the vector can have its own learning rate (`wide_lr`): the model uses it as
the id's first-order (wide) weight, which wants larger steps than the factors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.checks import check_fields, one_of
from store.errors import StoreError

SPARSE_OPTIMIZERS = ("ftrl", "adagrad", "adam", "sgd")


@dataclass(frozen=True)
class SparseOptimConfig:
    name: str = one_of(SPARSE_OPTIMIZERS, "ftrl")  # the rule
    lr: float = 0.05  # learning rate of the vector's columns (FTRL: alpha)
    wide_lr: float = 0.0  # learning rate of the vector's last column; 0 = the same as lr
    l2: float = 0.0  # L2 penalty on the touched rows (lazy: applied when a row is updated)
    eps: float = 1e-8  # Adam / Adagrad denominator epsilon
    beta1: float = 0.9  # Adam first-moment decay
    beta2: float = 0.999  # Adam second-moment decay
    initial_accumulator: float = 0.0  # Adagrad / FTRL: added to the squared-gradient sum (damps first steps)
    ftrl_beta: float = 1.0  # FTRL-Proximal beta (learning-rate schedule offset)
    ftrl_l1: float = 0.0  # FTRL-Proximal L1 (sparsifies weights; 0 for embeddings)
    clip_ratio: float = 0.0  # CowClip r: clip an id's gradient to count * max(r * |w|, clip_floor); 0 = off
    clip_floor: float = 1e-5  # CowClip zeta: the smallest clipping threshold per occurrence
    # the last column learns event by event inside a batch (trainer/wide.py), not by this module's
    # batch step: EmbeddingTable.update is then given those columns (not clipped: one event at a time)
    wide_per_event: bool = False

    def __post_init__(self) -> None:
        check_fields(self, "SparseOptimConfig", StoreError)


def column_lr(cfg: SparseOptimConfig, dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(dim,) learning rates: lr for the factor columns, wide_lr for the last (first-order) one."""
    lr = torch.full((dim,), cfg.lr, dtype=torch.float32, device=device)
    if cfg.wide_lr > 0:
        lr[-1] = cfg.wide_lr
    return lr


def cowclip(grad: torch.Tensor, vectors: torch.Tensor, counts: torch.Tensor, cfg: SparseOptimConfig) -> torch.Tensor:
    """Adaptive column-wise clipping (Zheng et al., CowClip, AAAI 2023): each id's gradient norm is
    held under counts * max(r * |w_id|, zeta), so large batches cannot blow a frequent id's row away.
    grad, vectors (u, dim); counts (u,) occurrences in the batch."""
    if cfg.clip_ratio <= 0:
        return grad
    limit = counts * torch.clamp(cfg.clip_ratio * vectors.norm(dim=1), min=cfg.clip_floor)
    norm = grad.norm(dim=1)
    scale = torch.where(norm > limit, limit / norm.clamp(min=1e-30), torch.ones_like(norm))
    return grad * scale[:, None]


Block = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (w, state_a, state_b), each (u, dim)
Tensor = torch.Tensor


def _sgd(row: Block, g: Tensor, lr: Tensor, step: int, cfg: SparseOptimConfig) -> Block:
    w, a, b = row
    return w - lr * g, a, b


def _adagrad(row: Block, g: Tensor, lr: Tensor, step: int, cfg: SparseOptimConfig) -> Block:
    w, total, unused = row
    total = total + g * g
    return w - lr * g / ((total + cfg.initial_accumulator).sqrt() + cfg.eps), total, unused


def ftrl_weights(z: Tensor, root: Tensor, lr: Tensor, cfg: SparseOptimConfig) -> Tensor:
    """FTRL-Proximal's closed form: the weights its state stands for, root = sqrt(n + initial_accumulator)."""
    denom = (root + cfg.ftrl_beta).div_(lr)
    if cfg.l2 > 0:
        denom.add_(cfg.l2)
    if cfg.ftrl_l1 <= 0:  # no L1 (embeddings): no shrinking, and a third of the elementwise passes
        return z.neg().div_(denom)
    shrunk = z - torch.sign(z) * cfg.ftrl_l1
    return torch.where(z.abs() <= cfg.ftrl_l1, torch.zeros_like(z), -shrunk / denom)


def _ftrl(row: Block, g: Tensor, lr: Tensor, step: int, cfg: SparseOptimConfig) -> Block:
    w, z, n = row
    n_new = torch.addcmul(n, g, g)
    root_old = (n + cfg.initial_accumulator).sqrt_()
    root_new = (n_new + cfg.initial_accumulator).sqrt_()
    sigma = (root_new - root_old).div_(lr)
    z = (z + g).sub_(sigma.mul_(w))
    return ftrl_weights(z, root_new, lr, cfg), z, n_new


def _adam(row: Block, g: Tensor, lr: Tensor, step: int, cfg: SparseOptimConfig) -> Block:
    w, m, v = row
    m = torch.lerp(m, g, 1 - cfg.beta1)  # beta1 * m + (1 - beta1) * g
    v = (v * cfg.beta2).addcmul_(g, g, value=1 - cfg.beta2)
    denom = (v / (1 - cfg.beta2**step)).sqrt_().add_(cfg.eps)
    return w - (m * (lr / (1 - cfg.beta1**step))).div_(denom), m, v


_RULES = {"sgd": _sgd, "adagrad": _adagrad, "ftrl": _ftrl, "adam": _adam}


# --- the row layout, spelled here only -----------------------------------------------------
def row_width(dim: int) -> int:
    """Floats per stored row: [vector (dim) | state_a (dim) | state_b (dim)]."""
    return 3 * dim


def row_dim(rows: torch.Tensor) -> int:
    """The vector width of stored rows (u, 3*dim)."""
    return rows.shape[1] // 3


def vectors_of(rows: torch.Tensor, dim: int) -> torch.Tensor:
    """rows (u, 3*dim) -> their vectors (u, dim): what the model reads (a view)."""
    return rows[:, :dim]


def split_rows(rows: torch.Tensor, dim: int) -> Block:
    """rows (u, 3*dim) -> (vector, state_a, state_b), each (u, dim) (views)."""
    return rows[:, :dim], rows[:, dim : 2 * dim], rows[:, 2 * dim :]


def wide_columns(dim: int) -> list[int]:
    """Where the last (first-order) column of each block sits in a row: its (w, state_a, state_b)."""
    return [dim - 1, 2 * dim - 1, 3 * dim - 1]


def row_grads(grad: torch.Tensor, wide_changes: torch.Tensor | None) -> torch.Tensor:
    """A row gradient as it travels between replicas and to a shard's owner: grad (u, dim), and
    with the wide column learned per event (trainer/wide.py) its (w, state_a, state_b) changes
    (u, 3) beside it: (u, dim) or (u, dim + 3). Averaged over the ranks like any row."""
    return grad if wide_changes is None else torch.cat([grad, wide_changes], dim=1)


def split_row_grads(packed: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The inverse of row_grads: (u, dim [+ 3]) -> (grad (u, dim), wide changes (u, 3) or None)."""
    return packed[:, :dim], (packed[:, dim:] if packed.shape[1] > dim else None)


def join_rows(vector: torch.Tensor, state_a: torch.Tensor, state_b: torch.Tensor) -> torch.Tensor:
    """The inverse of split_rows: (u, dim) x 3 -> (u, 3*dim)."""
    return torch.cat([vector, state_a, state_b], dim=1)


def sparse_step(rows: torch.Tensor, grad: torch.Tensor, step: int, cfg: SparseOptimConfig) -> torch.Tensor:
    """One update of rows (u, 3*dim) with grad (u, dim) at global step `step` (1-based). Pure."""
    d = grad.shape[1]
    w, a, b = split_rows(rows, d)
    lr = column_lr(cfg, d, rows.device)
    if cfg.l2 > 0 and cfg.name != "ftrl":  # FTRL takes its L2 in its closed form
        grad = grad + cfg.l2 * w
    return join_rows(*_RULES[cfg.name]((w, a, b), grad, lr, step, cfg))
