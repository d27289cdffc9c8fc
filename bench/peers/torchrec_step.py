"""The TorchRec peer of `adstream bench step`: the default model's shape in TorchRec, timed on the
batches the bench wrote. Run by the peer's own interpreter (`make peers`: .peers/torchrec), never
imported by the project (TorchRec's FBGEMM does not load under the project's torch):

    .peers/torchrec/bin/python bench/peers/torchrec_step.py INPUT.npz  > result.json

INPUT.npz (bench/peer.py writes it): `ids` (N, F) int64, each field's ids numbered 0..rows_f - 1;
`dense` (N, D) float32; `labels` (N,) float32; `rows_per_field` (F,); `spec`, a JSON text with
embed_dim, cross_layers, hidden, batch, lr, sparse_lr, warmup_share, threads.

The model is adstream's DCN-v2 in TorchRec's parts, per event:
  rows    FusedEmbeddingBagCollection, one table per field, FBGEMM's fused row-wise Adagrad;
          a row is E factor values + 1 first-order weight, padded to a multiple of 4 (FBGEMM's rule)
  logit = bias + sum of first-order weights + linear(dense) + MLP(CrossNet(x0)), x0 = [factors, dense]
  dense   Adam at `lr` (CrossNet, MLP, the output layer, bias and the dense linear term)
Each batch: KeyedJaggedTensor built from the ids (a data pipeline's last step), forward, BCE loss,
backward (the fused optimizer updates the rows inside it), the dense optimizer's step.

Three runs, all reported: "stock", TorchRec's CrossNet as shipped (it multiplies the kernel with
each event's (N, 1) column, a batched matrix-vector product); "gemm_cross", the same kernels and
biases applied to the whole batch in one matrix product (as adstream's cross layers are); and
"lr", adstream's `lr` family (the wide part alone over rows of lr_embed_dim + 1, no network), where
nearly all of a step is the rows' machinery: FBGEMM's fused rows against adstream's store.
Initialization follows adstream's: rows ~ N(0, 0.01), the output layer at zero.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torchrec.modules.crossnet import CrossNet
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from torchrec.modules.mlp import MLP
from torchrec.optim import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def padded(width: int) -> int:
    return -(-width // 4) * 4


class GemmCross(nn.Module):
    """CrossNet's parameters and function, x_{l+1} = x0 * (W_l x_l + b_l) + x_l, as one (B, N) x (N, N)
    matrix product per layer."""

    def __init__(self, cross: CrossNet) -> None:
        super().__init__()
        self.kernels, self.bias = cross.kernels, cross.bias

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for kernel, bias in zip(self.kernels, self.bias, strict=True):
            x = x0 * (x @ kernel.t() + bias.t()) + x
        return x


class PeerDcn(nn.Module):
    def __init__(self, rows_per_field: list[int], num_dense: int, spec: dict, variant: str) -> None:
        super().__init__()
        e = spec["lr_embed_dim"] if variant == "lr" else spec["embed_dim"]
        self.deep = variant != "lr"
        self.fields, self.e, self.row = len(rows_per_field), e, padded(e + 1)
        self.keys = [f"f{f}" for f in range(self.fields)]
        tables = [
            EmbeddingBagConfig(name=f"t{f}", embedding_dim=self.row, num_embeddings=n, feature_names=[self.keys[f]])
            for f, n in enumerate(rows_per_field)
        ]
        self.rows = FusedEmbeddingBagCollection(
            tables=tables,
            optimizer_type=RowWiseAdagrad,
            optimizer_kwargs={"lr": spec["sparse_lr"]},
            device=torch.device("cpu"),
        )
        width = self.fields * e + num_dense
        self.bias = nn.Parameter(torch.zeros(1))
        self.dense_linear = nn.Linear(num_dense, 1, bias=False)
        if self.deep:
            self.cross = CrossNet(width, spec["cross_layers"])
            if variant == "gemm_cross":
                self.cross = GemmCross(self.cross)
            self.mlp = MLP(width, list(spec["hidden"]))
            self.out = nn.Linear(spec["hidden"][-1], 1)
            nn.init.zeros_(self.out.weight)
            nn.init.zeros_(self.out.bias)
        with torch.no_grad():
            for weight in self.rows.state_dict().values():  # views of FBGEMM's weights
                weight.normal_(0.0, 0.01)
                weight[:, e + 1 :] = 0.0

    def features(self, ids: torch.Tensor) -> KeyedJaggedTensor:
        """(B, F) row numbers -> one id per field and event, feature-major as TorchRec wants."""
        b = ids.shape[0]
        lengths = torch.ones(self.fields * b, dtype=torch.int32)
        return KeyedJaggedTensor.from_lengths_sync(keys=self.keys, values=ids.t().reshape(-1), lengths=lengths)

    def forward(self, ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        pooled = self.rows(self.features(ids)).values().view(len(ids), self.fields, self.row)
        factors, first = pooled[..., : self.e], pooled[..., self.e]
        logit = self.bias + first.sum(dim=1) + self.dense_linear(dense).squeeze(1)
        if not self.deep:
            return logit
        x0 = torch.cat([factors.flatten(1), dense], dim=1)
        return logit + self.out(self.mlp(self.cross(x0))).squeeze(1)

    def part_sizes(self, rows_per_field: list[int]) -> dict[str, int]:
        """Parameters per part, the rows counted at their used width (E + 1), as adstream counts them."""
        cross = sum(p.numel() for p in self.cross.parameters())
        mlp = sum(p.numel() for p in self.mlp.parameters()) + sum(p.numel() for p in self.out.parameters())
        wide = self.bias.numel() + self.dense_linear.weight.numel()
        return {"rows": sum(rows_per_field) * (self.e + 1), "cross": cross, "mlp": mlp, "wide": wide}

    def dense_macs_per_event(self) -> int:
        """Multiply-adds of the dense layers per event (cross kernels, MLP, output, dense linear)."""
        cross = sum(k.numel() for k in self.cross.kernels)
        linears = [m for m in [*self.mlp.modules(), self.out, self.dense_linear] if isinstance(m, nn.Linear)]
        return cross + sum(m.weight.numel() for m in linears)


def timed_run(data: np.lib.npyio.NpzFile, spec: dict, variant: str) -> tuple[PeerDcn, dict]:
    """One fresh model learns every batch; the figures of the part after the warm-up share."""
    torch.manual_seed(0)
    rows_per_field = [int(n) for n in data["rows_per_field"]]
    ids, dense, labels = (torch.from_numpy(data[k]) for k in ("ids", "dense", "labels"))
    model = PeerDcn(rows_per_field, dense.shape[1], spec, variant)
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("rows.")]
    optimizer = torch.optim.Adam(dense_params, lr=spec["lr"])
    batch = spec["batch"]
    starts = list(range(0, len(ids), batch))
    warmup = max(1, int(len(starts) * spec["warmup_share"]))
    losses = []
    for i, s in enumerate(starts):
        if i == warmup:
            started = time.perf_counter()
        logits = model(ids[s : s + batch], dense[s : s + batch])
        loss = F.binary_cross_entropy_with_logits(logits, labels[s : s + batch])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    seconds = time.perf_counter() - started
    timed = starts[warmup:]
    events = len(ids) - timed[0]
    tenth = max(1, len(losses) // 10)
    return model, {
        "steps": len(timed),
        "events": events,
        "seconds": seconds,
        "events_per_s": events / seconds,
        "ms_per_step": 1000 * seconds / len(timed),
        "loss_first_tenth": float(np.mean(losses[:tenth])),
        "loss_last_tenth": float(np.mean(losses[-tenth:])),
    }


def main(path: str) -> dict:
    import fbgemm_gpu
    import torchrec

    data = np.load(path)
    spec = json.loads(str(data["spec"]))
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    runs = {}
    for variant in ("lr", "stock", "gemm_cross"):
        model, runs[variant] = timed_run(data, spec, variant)
    best = max(("stock", "gemm_cross"), key=lambda name: runs[name]["events_per_s"])
    return {
        "peer": "torchrec",
        "versions": {
            "torch": torch.__version__,
            "torchrec": torchrec.__version__,
            "fbgemm_gpu": fbgemm_gpu.__version__,
        },
        "sparse_optimizer": "row-wise Adagrad (FBGEMM, fused into backward)",
        "batch": spec["batch"],
        "threads": torch.get_num_threads(),
        "row_width_allocated": model.row,
        "params": model.part_sizes([int(n) for n in data["rows_per_field"]]),
        "dense_macs_per_event": model.dense_macs_per_event(),
        "runs": runs,
        "best": best,  # of the default model's two runs
        "events_per_s": runs[best]["events_per_s"],
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
