"""Trainer: a replica (trainer/replica.py) with its group layout and its checkpointer, chosen once
at start. What the loop, the benchmarks and the tests hold.

    trainer.learn_round(batch)   this replica's part of a round, by its layout (trainer/layouts.py)
    trainer.merge()              the k-step merge (a collective)
    trainer.checkpoints          snapshots, publications and their rounds (trainer/checkpoint.py)
    trainer.learn(batch)         a local step, as a lone trainer takes
"""

from __future__ import annotations

import numpy as np

from stream.schema import Schema
from trainer.batch import Batch
from trainer.checkpoint import Checkpointer
from trainer.layouts import layout_of
from trainer.merge import MergeStats
from trainer.replica import Replica
from trainer.settings import TrainerSettings


class Trainer(Replica):
    def __init__(self, schema: Schema, settings: TrainerSettings, counted: bool = True) -> None:
        super().__init__(schema, settings, counted)
        self.layout = layout_of(self)  # how this replica learns in its group
        self.checkpoints = Checkpointer(self)  # its snapshot files and publication rounds

    def learn_round(self, batch: Batch | None) -> np.ndarray | None:
        """This replica's part of one learning round, by the group's layout. Returns this replica's
        predictions (B,) made before the update (None without a batch)."""
        return self.layout.learn(batch)

    def merge(self) -> MergeStats:
        """The k-step merge of the group's replicas (a collective)."""
        return self.layout.merge()
