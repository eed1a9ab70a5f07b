"""Which decoder layers each pipeline stage owns: contiguous ranges, given by the user (pp_layer_partition) or
balanced by what each stage reads per step."""
from __future__ import annotations


def stage_layer_counts(num_layers: int, num_stages: int, layer_partition: tuple[int, ...] | None = None,
                       layer_cost: float = 1.0, head_cost: float = 0.0) -> tuple[int, ...]:
    """Layers per stage: layer_partition, checked against the model, else balanced_partition."""
    counts = layer_partition or balanced_partition(num_layers, num_stages, layer_cost, head_cost)
    if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(f"layer partition {list(counts)} does not give each of {num_stages} pipeline stages "
                         f"at least one of the model's {num_layers} layers")
    return counts


def balanced_partition(num_layers: int, num_stages: int, layer_cost: float = 1.0,
                       head_cost: float = 0.0) -> tuple[int, ...]:
    """Layers per stage, contiguous: the last stage, which also pays head_cost, takes the number of layers
    that makes the costliest stage cheapest; the others split the rest evenly (earlier stages take any
    remainder)."""
    if num_stages > num_layers:
        raise ValueError(f"pipeline_parallel_size {num_stages} is more than the model's {num_layers} layers")
    if num_stages == 1:
        return (num_layers,)
    first = num_stages - 1

    def worst(last: int) -> float:
        return max(-(-(num_layers - last) // first) * layer_cost, last * layer_cost + head_cost)

    last = min(range(1, num_layers - first + 1), key=lambda k: (worst(k), k))
    rest = num_layers - last
    return tuple(rest // first + (i < rest % first) for i in range(first)) + (last,)
