"""The dense gradients averaged over the group every step, each weight matrix sent as a rank-r
product (PowerSGD, Vogels et al., NeurIPS 2019) with error feedback.

Why: with k-step merging every replica takes k Adam steps of its own on the deep network before
the average, and at 8 replicas that loses accuracy the rows do not (#28, 2M synthetic events, 8
workers, k = 16, window AUC: dense merged 0.8180; the full gradients averaged every step 0.8223;
synchronous 0.8235). Averaging the full gradients every step costs the whole network's bytes each
step; a rank-r product costs (n + m) r of an (n, m) matrix's n m (the default DCN's 637 x 637 cross
weights at the default r = 48, in bfloat16: 13x fewer bytes; window AUC 0.8219).

Per step, for each weight matrix's gradient G (n, m) on each replica:
    M = G + E                     E: what earlier compressions left out (this replica's, kept)
    P = mean over replicas(M Q)   (n, r); Q (m, r) is the last step's, the same on every replica
    P = orthonormal columns of P
    Q = mean over replicas(M^T P) (m, r)
    G = P Q^T                     the same on every replica: their Adam steps stay identical
    E = M - P Q^T
Vectors and small matrices (biases, the wide part, min(n, m) <= 2 r) are averaged as they are.
P and Q may cross the network as bfloat16 (trainer.group.dense_wire): half the bytes; every replica
receives the same rounded means, so they still take the same step, and what the rounding took off
P Q^T lands in E with the rest of what the compression left out.
Every replica then takes the same dense step, so a merge has no dense part left to average. With
rows sharded within nodes (trainer.shard_within_node) the group is rank r of every node: each node
has averaged its gradients exactly first, so its ranks hold the same M and E and stay identical.

The compression's state lives in the dense optimizer's state of each matrix ("powersgd_q",
"powersgd_error"), so a snapshot holds it and a restore brings it back with Adam's moments. Only the
replicas' mean error matters (P, Q and P Q^T depend on the mean of M alone), so before a snapshot
every replica takes the mean error (`share_errors`): that changes nothing of what follows, and rank
0's snapshot then holds the group's whole state. A job resumed from it continues exactly as the
uninterrupted one.
"""

from __future__ import annotations

import torch

from trainer.merge import Group, average_tensors, ensure_optimizer_state


class PowerSgd:
    """One replica's compression state: the Q of each compressed matrix (shared, seeded) and its
    error E (its own). Built from the model so every replica lists the same parameters in order."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        rank: int,
        seed: int = 0,
        group: Group = None,
        wire: torch.dtype = torch.float32,
    ) -> None:
        self.rank, self.optimizer, self.group = rank, optimizer, group
        self.wire = wire  # the dtype P and Q cross the network in (the error feedback takes its rounding back)
        self.bytes_sent = 0  # what all_reduce has sent in all (bench merge: the bytes between nodes)
        params = list(model.parameters())
        self.matrices = [p for p in params if p.ndim == 2 and min(p.shape) > 2 * rank]
        ids = {id(p) for p in self.matrices}
        self.plain = [p for p in params if id(p) not in ids]
        self.seed = seed
        self.fill_state()

    def fill_state(self) -> None:
        """Q drawn from the seed (the same on every replica) and E = 0 for every matrix whose
        optimizer state has none (a fresh job, or a snapshot written without compression). Called again
        after a restore, which replaces the optimizer's state."""
        if all("powersgd_q" in self.optimizer.state.get(p, {}) for p in self.matrices):
            return
        ensure_optimizer_state(self.optimizer)  # its own state first: the optimizer fills an empty state only
        generator = torch.Generator().manual_seed(self.seed)
        for p in self.matrices:
            q = torch.linalg.qr(torch.randn(p.shape[1], self.rank, generator=generator))[0]
            state = self.optimizer.state[p]
            if "powersgd_q" not in state:
                state["powersgd_q"], state["powersgd_error"] = q, torch.zeros(p.shape)

    @property
    def qs(self) -> list[torch.Tensor]:
        """Each matrix's Q (m, r)."""
        return [self.optimizer.state[p]["powersgd_q"] for p in self.matrices]

    @property
    def errors(self) -> list[torch.Tensor]:
        """Each matrix's error E (n, m), this replica's."""
        return [self.optimizer.state[p]["powersgd_error"] for p in self.matrices]

    def share_errors(self) -> int:
        """Every replica's error becomes the group's mean error (what follows depends on the mean
        alone). Collective. Returns the bytes sent."""
        return average_tensors(self.errors, group=self.group)

    def all_reduce(self) -> int:
        """Replace every parameter's .grad (None counts as zeros) by its group average, the
        matrices' as rank-r products. Collective over `group` (None: every rank; rows sharded
        within nodes: rank r of each node, whose node's ranks hold the same average already).
        Returns the bytes this replica sent."""
        group = self.group
        for param in self.matrices + self.plain:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        sent = average_tensors([p.grad for p in self.plain if p.grad is not None], group=group)
        if self.matrices:
            sent += self._compressed_mean(group)
        self.bytes_sent += sent
        return sent

    def _compressed_mean(self, group: Group) -> int:
        """The matrices' .grad replaced by the rank-r approximation of their group mean, the error
        kept (the module's steps). Returns the bytes sent."""
        ms = [p.grad.detach().cpu() + e for p, e in zip(self.matrices, self.errors, strict=True)]  # type: ignore[union-attr]
        ps = [m @ q for m, q in zip(ms, self.qs, strict=True)]
        sent = average_tensors(ps, group=group, wire=self.wire)
        ps = [torch.linalg.qr(p)[0] for p in ps]
        qs = [m.t() @ p for m, p in zip(ms, ps, strict=True)]
        sent += average_tensors(qs, group=group, wire=self.wire)
        for param, m, p_, q in zip(self.matrices, ms, ps, qs, strict=True):
            approx = p_ @ q.t()
            state = self.optimizer.state[param]
            state["powersgd_q"] = q
            state["powersgd_error"] = m - approx
            param.grad.copy_(approx.to(param.grad.device))  # type: ignore[union-attr]
        return sent
