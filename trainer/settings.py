"""Trainer settings: one dataclass per concern, nested under [trainer] in the config.

    [trainer]            the job: consumer group, batch size, device, metrics, threads
    [trainer.model]      ModelSettings     the network (family, widths)
    [trainer.optim]      OptimSettings     the dense and the sparse optimizer
    [trainer.store]      StoreSettings     where the embedding rows live, budgets, admission
    [trainer.snapshot]   SnapshotSettings  when and where snapshots are taken
    [trainer.group]      GroupSettings     replicas and how often they merge

Built by adstream/config.py from TOML or `--set trainer.optim.lr=0.01`; unknown keys are errors
there, bad values here (each dataclass checks its own fields when it is built).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from common.checks import at_least, check_fields, coerce_like, default_of, one_of, with_changes
from store.configs import HierarchyConfig, TableConfig
from store.rocks import TABLE_FORMATS
from store.sparse_optim import SPARSE_OPTIMIZERS, SparseOptimConfig
from trainer.errors import TrainerError
from trainer.model import DELAYED_FEEDBACK, FAMILIES, MODEL_KINDS, ModelConfig

# the challengers of a default trainer: the lr family (a logistic regression, ~1/6 of a DCN step)
# with each sparse optimizer at the rates that suit it, the pair that disagree most on the logs we
# know (FTRL at 0.05 is the better LR on the real rows' first half, 0.7201 vs 0.7121 AUC; Adagrad at
# 0.1 on the synthetic stream, 0.7955 vs 0.7897, there as good as the DCN), and DeepFM
DEFAULT_CHALLENGERS = (
    "model.kind=lr",
    "model.kind=lr optim.sparse_optimizer=adagrad optim.wide_lr=0.1 optim.initial_accumulator=1",
    "model.kind=deepfm",
)
RATE_BATCH = 256  # the batch size the family rates were tuned at


def family_sparse_lr(kind: str, batch_size: int) -> float:
    """What sparse_lr = 0 means: the family's factor rate, times sqrt(batch_size / 256) above 256.
    A batch's summed gradient grows with its size and so does FTRL's / Adagrad's accumulator: one
    step of a 16x larger batch moves a row about as far as one small step, not 16. The square-root
    rule for adaptive optimizers (Malladi et al., 2022) gives the rows back their pace: on the
    synthetic stream at batch 4096, 0.15 -> 0.6 took the AUC from 0.8091 to 0.8106 (batch 256:
    0.8132). Smaller batches keep the family's rate (tuned there, with the wide part per event)."""
    return FAMILIES[kind].sparse_lr * max(1.0, (batch_size / RATE_BATCH) ** 0.5)


@dataclass(frozen=True)
class ModelSettings:
    kind: str = one_of(
        MODEL_KINDS, default_of(ModelConfig, "kind")
    )  # model family: "lr", "fm", "deepfm" or "dcn" (DCN-v2)
    embed_dim: int = at_least(0, 0)  # factor width per field; 0 = the family's default (dcn 16, others 8)
    hidden: tuple[int, ...] = default_of(ModelConfig, "hidden")  # MLP widths (deepfm, dcn)
    cross_layers: int = at_least(0, default_of(ModelConfig, "cross_layers"))  # cross layers (dcn)
    cross_rank: int = at_least(
        0, default_of(ModelConfig, "cross_rank")
    )  # dcn cross weights: 0 = full rank; r > 0 = low rank U V^T (cheaper)
    dense_norm: bool = default_of(
        ModelConfig, "dense_norm"
    )  # standardize the dense features by running mean / variance

    def __post_init__(self) -> None:
        check_fields(self, "trainer.model", TrainerError)


@dataclass(frozen=True)
class OptimSettings:
    # the dense optimizer (the network)
    optimizer: str = one_of(("adam", "sgd"), "adam")  # "adam" (Adagrad at wide_lr on the wide part) or "sgd" (tests)
    lr: float = at_least(0, 0.003)  # learning rate of the dense network
    warmup_steps: int = at_least(0, 0)  # dense learning rate ramps up linearly over this many steps; 0 = none
    # the sparse optimizer (the embedding rows; its state is stored in each row)
    sparse_optimizer: str = one_of(
        SPARSE_OPTIMIZERS, default_of(SparseOptimConfig, "name")
    )  # "ftrl" (FTRL-Proximal), "adagrad", "adam", "sgd"
    # factor columns' rate (FTRL: alpha); 0 = the family's (dcn 0.15, others 0.05) x sqrt(batch_size / 256) above 256
    sparse_lr: float = at_least(0, 0.0)
    wide_lr: float = at_least(0, 0.05)  # rate of the wide part: ids' first-order weights, bias, dense linear term
    # ids' first-order weights learn event by event inside each batch, as an online LR does
    # (trainer/wide.py); false: one step per batch like the factors. Synchronous and sharded
    # steps average the replicas' per-event changes of a row, as they average its gradients
    wide_per_event: bool = True
    sparse_l2: float = at_least(0, default_of(SparseOptimConfig, "l2"))  # L2 penalty on the rows a step touches
    initial_accumulator: float = at_least(
        0, default_of(SparseOptimConfig, "initial_accumulator")
    )  # Adagrad / FTRL: start of each squared-gradient sum
    init_std: float = at_least(0, default_of(TableConfig, "init_std"))  # std of a new row's initial vector
    clip_ratio: float = at_least(
        0, default_of(SparseOptimConfig, "clip_ratio")
    )  # CowClip r: id grad norm <= count * max(r * |w|, 1e-5); 0 = off
    # learning from the joiner's fake_negative policy (every impression first a negative, a click a
    # positive copy): "fnw" weights the loss back to the true one, "fnc" learns the biased labels and
    # predicts p = b / (1 - b) (trainer/delayed.py); "none" for final labels (the window policy)
    delayed_feedback: str = one_of(DELAYED_FEEDBACK, default_of(ModelConfig, "delayed_feedback"))

    def __post_init__(self) -> None:
        check_fields(self, "trainer.optim", TrainerError)


@dataclass(frozen=True)
class StoreSettings:
    kind: str = one_of(("ram", "tiered"), "ram")  # "ram" (one in-memory tier) or "tiered" (device -> RAM -> RocksDB)
    ram_bytes: int = at_least(1, 2 << 30)  # budget of the in-memory (RAM) tier, bytes
    # budget of the device tier (kind = "tiered"), bytes; CUDA only: a CPU trainer's top cache is the RAM tier
    device_bytes: int = at_least(1, 256 << 20)
    disk_bytes: int = at_least(1, 64 << 30)  # budget of the RocksDB tier (kind = "tiered"), bytes
    path: str = ".state/rocksdb/trainer"  # RocksDB directory (kind = "tiered")
    # tiered, one folder per NUMA node (index = node, e.g. ["/nvme0/adstream", "/nvme1/adstream"]): each
    # rank's RocksDB goes where the topology plan puts its GPU (<folder of its node>/gpu<N>); () = path
    numa_paths: tuple[str, ...] = ()
    eviction: str = one_of(
        ("lru", "lfu"), default_of(HierarchyConfig, "policy")
    )  # eviction policy of the device and RAM tiers (kind = "tiered")
    ttl_steps: int = at_least(
        0, default_of(HierarchyConfig, "ttl_steps")
    )  # drop rows unseen for this many steps; 0 = never (kind = "tiered")
    # RocksDB's table files (kind = "tiered"): "plain" (hash-indexed, the fastest cold reads; holds ~14
    # bytes of RAM per row on disk) or "block" (block-based: ~1.5x slower cold reads, a few bytes a row)
    rocksdb_format: str = one_of(TABLE_FORMATS, default_of(HierarchyConfig, "rocksdb_format"))
    pipelined: bool = default_of(
        HierarchyConfig, "pipelined"
    )  # tiered: read the next batch's cold rows during this step, write back async
    min_count: int = at_least(
        1, default_of(TableConfig, "min_count")
    )  # batches an id must appear in before it gets its own row (before: a shared row)
    admission_bytes: int = at_least(
        1, default_of(TableConfig, "admission_bytes")
    )  # memory of the admission counters (count-min sketch), bytes

    def __post_init__(self) -> None:
        check_fields(self, "trainer.store", TrainerError)
        tiered_only = self.ttl_steps or self.eviction != "lru" or self.numa_paths or self.rocksdb_format != "plain"
        if self.kind == "ram" and tiered_only:
            raise TrainerError(
                f"config trainer.store.ttl_steps={self.ttl_steps} / trainer.store.eviction={self.eviction!r} / "
                f"trainer.store.numa_paths={list(self.numa_paths)} / trainer.store.rocksdb_format="
                f"{self.rocksdb_format!r} act only on the tiered store: set trainer.store.kind = "
                '"tiered", or leave them at their defaults (0, "lru", [], "plain")'
            )


@dataclass(frozen=True)
class SnapshotSettings:
    every_steps: int = at_least(1, 200)  # take a snapshot after this many steps...
    every_s: float = at_least(0, 60.0)  # ...or this many seconds, whichever comes first
    publish_every_s: float = at_least(0, 5.0)  # serving gets a delta (rows changed since) this often; 0 = bases only
    dir: str = ".state/snapshots"  # local folder for snapshots before upload
    keep: int = at_least(
        1, 3
    )  # recovery snapshots kept there (the newest); older ones are deleted once a newer one is durable

    def __post_init__(self) -> None:
        check_fields(self, "trainer.snapshot", TrainerError)


@dataclass(frozen=True)
class GroupSettings:
    workers: int = at_least(1, 1)  # replicas `adstream train` starts (one process each; torchrun sets its own)
    merge_every_steps: int = at_least(0, 16)  # k: replicas average their models every k steps; 0 = sync data parallel
    merge_every_s: float = at_least(0, 0.0)  # also merge this many seconds after the last merge; 0 = only every k steps
    # how a merge combines a row several replicas wrote (trainer/merge.py): "deltas", their changes
    # since the last merge added up on the row they started from and divided by writers ^
    # row_deltas_power (1: their mean change; 0: every change, as a parameter server), never more
    # than twice their mean change (merge.MAX_DELTAS_GAIN; FTRL's weights re-derived from the
    # merged z and n), or "mean", the mean of their rows. 2M synthetic
    # events, 4 workers, k = 16, the window AUC of the stream's last 20%: "deltas" 0.8252, "mean"
    # 0.8236, synchronous 0.8262 (`adstream bench merge`: "deltas" at 2/4/8 workers in the README)
    row_merge: str = one_of(("mean", "deltas"), "deltas")
    row_deltas_power: float = at_least(0, 0.5)  # "deltas": the changes' sum over writers ^ this
    # the dense network between merges (k > 0): "powersgd", its gradients averaged every step, each
    # weight matrix sent as a rank-dense_rank product with error feedback (trainer/compress.py), so
    # every replica takes the same dense step and merges average only the rows (rows sharded within
    # nodes: each node's exact average, then compressed between the nodes); "merge", each replica
    # steps on its own gradients and merges average the parameters and Adam moments. 2M synthetic
    # events, 8 workers, k = 16, window AUC: powersgd 0.8217 (rank 32), merge 0.8180, synchronous 0.8235
    dense_exchange: str = one_of(("merge", "powersgd"), "powersgd")
    # "powersgd": the rank r; an (n, m) matrix costs (n + m) r numbers a step, sent whole if
    # min(n, m) <= 2 r (float32, in the run above: rank 4 0.8188, 16 0.8204, 32 0.8217 at 1.25 GB,
    # the full gradients 0.8223 at 7.4 GB; bfloat16, trainer seeds 0 and 1: 32 0.8215 / 0.8213 at
    # 0.84 GB, 48 0.8219 / 0.8214 at 1.04 GB, 64 0.8223 at 1.70 GB, the DCN's (637, 128) sent whole)
    dense_rank: int = at_least(1, 48)
    # "powersgd": the dtype its factors cross the network in: "bfloat16" sends half the bytes of
    # "float32" at the same accuracy (the rounding is kept by the error feedback, as the rank's is;
    # 4 workers, k = 16: 0.8261 both; 8 workers: the means of two seeds 0.8214 both)
    dense_wire: str = one_of(("float32", "bfloat16"), "bfloat16")
    max_restarts: int = at_least(0, 3)  # the supervisor of `--workers N` restarts the whole group this often

    def __post_init__(self) -> None:
        check_fields(self, "trainer.group", TrainerError)


@dataclass(frozen=True)
class TrainerSettings:
    group_id: str = "adstream-trainer"  # Kafka consumer group on the batches topic
    batch_size: int = at_least(1, 256)  # events per train step (whole stream batches are never split); see the README
    seed: int = 0  # seeds the dense init and the embedding initializer
    device: str = "cpu"  # where the model and the device tier live: "cpu" or "cuda[:N]"
    threads: int = at_least(0, 0)  # torch threads; 0 = torch's default
    idle_s: float = at_least(0, 1.0)  # with no full batch after this long, learn what there is (or report idle)
    metrics_window: int = at_least(1, 10_000)  # events in the sliding-window AUC/logloss
    # under optim.delayed_feedback "fnw"/"fnc" (the joiner's fake_negative policy): the metrics score
    # each impression once, against its label this many event-time seconds after it first came; 0
    # (the default) = the joiner's stream.join.window_s + allowed_lateness_s, filled in by the config
    label_wait_s: float = at_least(0, 0.0)
    log_every_steps: int = at_least(1, 20)  # MLflow metrics every this many steps
    metrics_port: int = at_least(0, 9400)  # Prometheus endpoint (rank r: port + r); 0 = off
    metrics_host: str = "127.0.0.1"  # interface it binds; "0.0.0.0" in a container, for the stack's network only
    learn_log: str = ""  # folder for per-replica audit logs of the (partition, offset) records learned; "" = off
    # rows sharded over the ranks of a node (trainer/shard.py): each row stored and updated by one
    # owner, synchronous steps within the node, k-step merges between nodes (group.merge_every_steps);
    # false keeps a full copy per replica
    shard_within_node: bool = False
    # challengers: other configurations that learn the same batches beside this one, each scored
    # progressively; the best of them so far is the one published (trainer/champion.py). Each
    # entry is space-separated changes of trainer.model.* / trainer.optim.*, e.g.
    # "model.kind=lr optim.sparse_optimizer=adagrad"; [] = none. Each has its own store with
    # these budgets and its own snapshots (under snapshot.dir/challengers/)
    challengers: tuple[str, ...] = DEFAULT_CHALLENGERS
    # the share of a step's time the challengers may take, measured over the first log_every_steps
    # steps: kept cheapest first while their share stays within it (0.5: the step at most twice
    # the lone model's); the others stop. 0 = no challengers
    challengers_budget: float = at_least(0, 0.5)
    # events between two choices of the champion: the member with the lowest logloss over the last
    # metrics_window events serves, if it beats the serving one's by switch_margin (relative) and
    # its AUC there is not lower by more than 0.002
    switch_every: int = at_least(1, 2_000)
    switch_margin: float = at_least(0, 0.005)
    model: ModelSettings = field(default_factory=ModelSettings)  # [trainer.model]
    optim: OptimSettings = field(default_factory=OptimSettings)  # [trainer.optim]
    store: StoreSettings = field(default_factory=StoreSettings)  # [trainer.store]
    snapshot: SnapshotSettings = field(default_factory=SnapshotSettings)  # [trainer.snapshot]
    group: GroupSettings = field(default_factory=GroupSettings)  # [trainer.group]

    def __post_init__(self) -> None:
        check_fields(self, "trainer", TrainerError)
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise TrainerError(f"config trainer.device={self.device!r}: use 'cpu', 'cuda' or 'cuda:N'")
        if self.challengers_budget >= 1:
            raise TrainerError(
                f"config trainer.challengers_budget={self.challengers_budget}: the challengers' share of a "
                "step must be below 1 (0.5: they may take half of it); 0 turns them off"
            )
        for index, text in enumerate(self.challengers):
            challenger_changes(self, text, index)
        if self.shard_within_node and self.store.min_count != 1:
            raise TrainerError(
                "config trainer.shard_within_node = true counts no sightings at the row's owner yet: set "
                f"trainer.store.min_count = 1 (it is {self.store.min_count}), or shard_within_node = false"
            )


CHANGEABLE = ("model", "optim")  # the sections a challenger may change (the rest is the job's)
FIXED = ("optim.delayed_feedback",)  # ...but not how the labels are learned: the join policy decides it


def challenger_changes(settings: TrainerSettings, text: str, index: int) -> dict[str, Any]:
    """A trainer.challengers entry as changes: 'model.kind=lr optim.sparse_optimizer=adagrad' ->
    {"model.kind": "lr", ...}, each value of the type the setting has; a bad entry names
    trainer.challengers[index] and the fix (trainer/champion.py builds a challenger from them)."""
    where = f"config trainer.challengers[{index}]={text!r}"
    changes: dict[str, Any] = {}
    for item in text.split():
        key, sep, value = item.partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot or section not in CHANGEABLE or key in FIXED:
            raise TrainerError(
                f"{where}: {item!r} is not a change of trainer.model.* or trainer.optim.* (delayed_feedback "
                "excepted); write space-separated key=value pairs, e.g. 'model.kind=lr optim.sparse_optimizer=adagrad'"
            )
        current = getattr(settings, section)
        names = [f.name for f in dataclasses.fields(current)]
        if name not in names:
            raise TrainerError(f"{where}: trainer.{section} has no key {name!r}; its keys: {sorted(names)}")
        default = getattr(current, name)
        try:
            changes[key] = coerce_like(value, default)
        except (TypeError, ValueError):
            raise TrainerError(
                f"{where}: {key}={value!r}: expected {type(default).__name__} like {default!r}"
            ) from None
    if not changes:
        raise TrainerError(f"{where}: no changes; write e.g. 'model.kind=lr', or remove the entry")
    try:
        with_changes(settings, {**changes, "challengers": ()})  # each section checks its own values
    except TrainerError as err:
        raise TrainerError(f"{where}: {err}") from None
    return changes


@dataclass(frozen=True)
class MlflowSettings:
    tracking_uri: str = "http://127.0.0.1:15000"  # MLflow tracking server
    experiment: str = "adstream"  # experiment of training runs
    model_name: str = "adstream-ctr"  # registered model name
    alias: str = "live"  # alias set on each new version ("latest" is reserved by MLflow)

    def __post_init__(self) -> None:
        if self.alias == "latest" or not self.alias:
            raise TrainerError(f"config mlflow.alias={self.alias!r}: 'latest' is reserved by MLflow; use e.g. 'live'")
