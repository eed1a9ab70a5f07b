"""Whether a model splits over tensor_parallel_size x pipeline_parallel_size ranks, and which kv heads (and, with
enable_expert_parallel, which experts) a tensor rank holds. Only the model's head, layer and expert counts matter,
so every model class shares these rules, and the executors check them before any worker starts."""
from __future__ import annotations

from qwenserve.config.errors import ConfigError
from qwenserve.distributed.partition import stage_layer_counts
from qwenserve.distributed.tensor_parallel import TensorParallel


def check_parallel_layout(config, tp_size: int, pp_size: int, layer_partition: tuple[int, ...] | None = None,
                          expert_parallel: bool = False) -> None:
    """Raise ValueError, naming the numbers, if the model (a ModelConfig) cannot be split this way."""
    check_head_split(config.num_attention_heads, config.num_key_value_heads, tp_size)
    stage_layer_counts(config.num_hidden_layers, pp_size, layer_partition)
    if expert_parallel:
        experts = config.extra.get("num_experts", config.extra.get("num_local_experts"))
        if isinstance(experts, int):  # a model without experts: the flag has no effect
            check_expert_split(experts, tp_size)


def check_expert_split(num_experts: int, tp_size: int) -> None:
    if num_experts < tp_size:
        raise ConfigError(f"enable_expert_parallel: num_experts {num_experts} is less than tensor_parallel_size "
                          f"{tp_size}, so some rank would hold no expert")


def local_experts(num_experts: int, tp: TensorParallel) -> tuple[int, int]:
    """(index of this rank's first expert, how many it holds) under expert parallelism: contiguous ranges as vLLM
    places them, the first num_experts % size ranks one more."""
    base, extra = divmod(num_experts, tp.size)
    return tp.rank * base + min(tp.rank, extra), base + (tp.rank < extra)


def check_head_split(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    if num_heads % tp_size:
        raise ValueError(f"tensor_parallel_size {tp_size} does not divide num_attention_heads {num_heads} "
                         f"(num_key_value_heads {num_kv_heads})")
    if num_kv_heads >= tp_size and num_kv_heads % tp_size:
        raise ValueError(f"tensor_parallel_size {tp_size} does not divide num_key_value_heads {num_kv_heads} "
                         f"(num_attention_heads {num_heads})")
    if num_kv_heads < tp_size and tp_size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {tp_size} is not a multiple of num_key_value_heads {num_kv_heads} "
                         f"(num_attention_heads {num_heads}), so kv heads cannot be replicated evenly")


def shard_kv_heads(num_kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """(kv heads this rank owns, index of its first kv head in the checkpoint).

    With at least as many kv heads as ranks they are split evenly; with fewer, each rank holds one kv head,
    replicated across the tp // num_kv_heads ranks whose query heads use it."""
    if num_kv_heads >= tp.size:
        per_rank = num_kv_heads // tp.size
        return per_rank, tp.rank * per_rank
    return 1, tp.rank // (tp.size // num_kv_heads)
