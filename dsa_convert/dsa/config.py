"""Typed options of the DSA retrofit (indexer training, sink/local split, ASQ fitting)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, Optional

from ..errors import BadInputError

SelectMode = Literal["token", "block"]
KeySpace = Literal["auto", "pre_rope", "post_rope"]


@dataclass
class DsaConfig:
    # ---- selection (FORMAT §2/§5)
    top_k: int = 512                    # K: total keys per query (sinks + local + indexer picks)
    sink: Optional[int] = None          # S; None -> calibrated together with local
    local: Optional[int] = None         # L; None -> calibrated (split.py)
    select: SelectMode = "token"
    block_size: int = 64
    # ---- indexer shape (FORMAT §3/§4)
    index_heads: int = 4                # H
    index_dim: int = 64                 # D
    rope_dim: int = 32                  # R (even, <= D)
    norm_eps: float = 1e-6
    index_share: int = 1                # G: ceil(n_layer / G) layers run their own indexer, the others reuse the top-k
                                        # of the last one before them ({arch}.attention.indexer.types, FORMAT §4a);
                                        # 1 = an indexer in every layer
    index_place: str = "search"         # which layers (G > 1): search = greedy on held-out calibration NLL, every
                                        # indexer trained on its own layer's target (placement.py); every = layers
                                        # 0, G, 2G, ..., each trained on its group's mean target
    # ---- ASQ (FORMAT §6); cluster_num None -> no ASQ tensors
    cluster_num: Optional[int] = 64
    residual_bits: int = 4
    key_space: KeySpace = "auto"        # auto -> chosen by measured reconstruction error
    asq_samples: int = 32768            # vectors per (layer, KV head, K/V) given to k-means
    # ---- calibration / training
    calib: Path = Path("calib.txt")
    ctx: Optional[int] = None           # calibration context (--calib-ctx); None -> the model's trained context,
                                        # capped by the memory the calibration activations need (CalibPlan)
    calib_tokens: Optional[int] = None  # training tokens (ctx x chunks); None -> 65536 up to a 2K context, else 524288
                                        # on a GPU and 65536 on a CPU (the CPU's time budget)
    calib_chunks: Optional[int] = None  # chunks of ctx tokens to train on; None -> calib_tokens // ctx (at least 1)
    steps: Optional[int] = None         # dense KL warm-up steps per layer; None -> the plan's recipe (calib.py)
    sparse_steps: Optional[int] = None  # sparse-phase KL steps per layer; None -> steps
    sparse_target: str = "middle"       # sparse-phase KL over: middle ([S, t-L], default) | selected (DeepSeek)
    lr: float = 2e-3
    query_rows: Optional[int] = None    # query rows sampled per step (from t >= top_k); None -> the plan's recipe
    split_search: str = "auto"          # S/L candidates scored by held-out NLL: full (9 sparse forwards) | coarse (3) |
                                        # auto (the plan's recipe; split.py)
    placement_search: str = "auto"      # which full layers (--index-share G, search): greedy | oneshot | auto (the
                                        # plan's recipe; placement.py)
    split_chunks: Optional[int] = None  # held-out chunks that score S/L candidates and the layer placement; None ->
                                        # an eighth of the training chunks, 1 to 4
    time_budget: Optional[float] = None  # seconds the retrofit should take (--time-budget): picks the calibration
                                        # context and recipe by a measured probe (calib.py, budget.py); None -> the
                                        # device's default (budget.DEFAULT_TIME_BUDGET); 0 -> no budget: the full
                                        # recipe at the model's context
    memory_budget: Optional[float] = None  # GiB the calibration activations may take (--memory-budget); None -> half
                                        # the free memory, on a CPU at most calib.DEFAULT_CPU_MEMORY
    device: str = "auto"                # auto | cpu | cuda | cuda:N
    seed: int = 0
    threads: Optional[int] = None       # torch CPU threads (None -> leave as is)
    extra: dict = field(default_factory=dict)

    def validate(self) -> "DsaConfig":
        """Raise BadInputError (one line) for unusable options; returns self."""
        if self.top_k <= 0:
            raise BadInputError(f"--top-k must be > 0 (got {self.top_k})")
        if self.sink is not None and self.sink < 0:
            raise BadInputError(f"--sink must be >= 0 (got {self.sink})")
        if self.local is not None and self.local < 1:
            raise BadInputError(f"--local must be >= 1 (the query itself) (got {self.local})")
        if (self.sink or 0) + (self.local or 0) > self.top_k:
            raise BadInputError(f"--sink + --local ({(self.sink or 0) + (self.local or 0)}) exceeds --top-k ({self.top_k})")
        if self.select not in ("token", "block"):
            raise BadInputError(f"--select must be token or block (got {self.select!r})")
        if self.block_size <= 0:
            raise BadInputError(f"--block-size must be > 0 (got {self.block_size})")
        if self.index_heads <= 0 or self.index_dim <= 0:
            raise BadInputError("indexer head count and dim must be > 0")
        if self.index_share < 1:
            raise BadInputError(f"--index-share must be >= 1 (got {self.index_share})")
        if self.index_place not in ("search", "every"):
            raise BadInputError(f"--index-place must be search or every (got {self.index_place!r})")
        if self.rope_dim % 2 or not 0 <= self.rope_dim <= self.index_dim:
            raise BadInputError(f"indexer rope_dim must be even and <= {self.index_dim} (got {self.rope_dim})")
        if self.cluster_num is not None and not 2 <= self.cluster_num <= 256:
            raise BadInputError(f"--cluster-num must be in [2, 256] (got {self.cluster_num})")
        if self.residual_bits not in (4, 8):
            raise BadInputError(f"--residual-bits must be 4 or 8 (got {self.residual_bits})")
        if self.key_space not in ("auto", "pre_rope", "post_rope"):
            raise BadInputError(f"key space must be auto, pre_rope or post_rope (got {self.key_space!r})")
        if (self.steps is not None and self.steps < 0) or (self.sparse_steps is not None and self.sparse_steps < 0):
            raise BadInputError("--steps must be >= 0")
        if self.query_rows is not None and self.query_rows < 1:
            raise BadInputError(f"--query-rows must be >= 1 (got {self.query_rows})")
        if self.split_search not in ("auto", "full", "coarse"):
            raise BadInputError(f"--split-search must be auto, full or coarse (got {self.split_search!r})")
        if self.placement_search not in ("auto", "greedy", "oneshot"):
            raise BadInputError(f"--placement-search must be auto, greedy or oneshot (got {self.placement_search!r})")
        if self.sparse_target not in ("selected", "middle"):
            raise BadInputError(f"sparse target must be selected or middle (got {self.sparse_target!r})")
        if self.calib_chunks is not None and self.calib_chunks < 1:
            raise BadInputError("need at least one calibration chunk")
        if self.split_chunks is not None and self.split_chunks < 0:
            raise BadInputError(f"split chunks must be >= 0 (got {self.split_chunks})")
        if self.ctx is not None and self.ctx < 16:
            raise BadInputError(f"--calib-ctx must be >= 16 (got {self.ctx})")
        if self.ctx is not None and self.top_k >= self.ctx:
            raise BadInputError(f"--top-k {self.top_k} must be smaller than --calib-ctx {self.ctx}")
        if self.time_budget is not None and not self.time_budget >= 0:
            raise BadInputError(f"--time-budget must be >= 0 seconds (got {self.time_budget})")
        if self.memory_budget is not None and not self.memory_budget > 0:
            raise BadInputError(f"--memory-budget must be > 0 GiB (got {self.memory_budget})")
        if self.calib_tokens is not None and self.calib_tokens < 1:
            raise BadInputError(f"--calib-tokens must be >= 1 (got {self.calib_tokens})")
        if not Path(self.calib).is_file():
            raise BadInputError(f"calibration file not found: {self.calib}")
        return self

    def indexer_types(self, n_layer: int) -> list[bool]:
        """Per layer: True = full (own indexer), False = shared (reuses the last full layer's top-k): the fixed
        pattern (`every`); with `search` the retrofit trains every layer and picks the full ones afterwards."""
        return indexer_types_every(n_layer, self.index_share)

    @property
    def searches_placement(self) -> bool:
        return self.index_share > 1 and self.index_place == "search"

    def resolve_device(self) -> str:
        import torch
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise BadInputError(f"--device {self.device} requested but CUDA is not available")
        return self.device

    def to_dict(self) -> dict:
        d = asdict(self)
        d["calib"] = str(self.calib)
        return d


def indexer_types_every(n_layer: int, share: int) -> list[bool]:
    """Full indexer layers every ``share`` layers from layer 0 (the pattern `--index-share` writes)."""
    return [il % share == 0 for il in range(n_layer)]


def full_layer_of(types: list[bool] | None, il: int, sources=None) -> int:
    """The layer whose top-k layer ``il`` attends over: itself when full, else the last full layer before it that
    has an indexer (``sources``: the layers with one; a full layer without is dense and no source, FORMAT §4a)."""
    if types is None or types[il]:
        return il
    j = il - 1
    while j >= 0 and not (types[j] and (sources is None or j in sources)):
        j -= 1
    if j < 0:
        raise BadInputError(f"layer {il} is shared (attention.indexer.types) but no full indexer layer precedes it")
    return j
