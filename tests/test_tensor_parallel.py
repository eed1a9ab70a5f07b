"""Tensor-parallel layers at tp = 2 and 4 (gloo, one process per rank) give tp = 1's logits.

The layers alone, outside the engine (whose worker processes test_distributed.py runs): the sharded weight
loaders, the all-reduce in the row-parallel layers, kv-head replication and the vocab-parallel embedding and
LM head."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qwenserve.distributed.groups import free_port

from helpers import save_gguf, save_hf_dir, tiny_hf_model, tiny_qwen3

pytestmark = pytest.mark.multiproc

IDS = list(range(3, 40))


def _rank_logits(rank: int, world: int, port: int, path: str, quantization: str, out):
    from qwenserve.config.engine_config import LoadConfig
    from qwenserve.model.loader.model_loader import load_model
    from qwenserve.distributed.tensor_parallel import TensorParallel
    from qwenserve.model.loader.resolve import resolve_model
    from qwenserve.worker.model_runner import full_logits

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        resolved = resolve_model(LoadConfig(model=path, dtype="float32", max_model_len=256, quantization=quantization))
        model = load_model(resolved, tp=TensorParallel(rank, world, dist.group.WORLD))
        logits = full_logits(model, IDS)
        out.put((rank, logits.numpy()))  # by value: a shared tensor dies with this process
        # every rank done before any tears gloo down: a rank that left first has aborted a slower one at exit
        # ("terminate called without an active exception", seen once on a loaded machine)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # the logits are sent; leave without the interpreter's teardown, in which gloo's threads have still aborted a
    # rank now and then after the barrier (SIGABRT, once in a full suite run on a loaded machine)
    out.close()
    out.join_thread()
    os._exit(0)


@pytest.mark.parametrize("tp,shape,quantization", [
    (2, dict(num_attention_heads=4, num_key_value_heads=2), "none"),  # kv heads split
    (2, dict(num_attention_heads=4, num_key_value_heads=1), "none"),  # one kv head, replicated
    (4, dict(num_attention_heads=4, num_key_value_heads=2, vocab_size=322), "none"),  # uneven vocab shards
    (2, dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True), "none"),
    # GGUF blocks split by rows and on block boundaries; the embedding's blocks by vocabulary rows
    (2, dict(num_attention_heads=4, num_key_value_heads=2, vocab_size=322), "gguf"),
    # Qwen3: heads wider than hidden / heads, per-head q/k norms each rank holds whole
    (2, dict(qwen3=True, num_attention_heads=4, num_key_value_heads=2), "none"),
])
def test_tensor_parallel_logits_equal_single_process(ops, tmp_path, tp, shape, quantization):
    from qwenserve.model.loader.model_loader import LoadedModel
    from qwenserve.worker.model_runner import full_logits

    shape = dict(shape)
    hf = tiny_qwen3(seed=31, **shape) if shape.pop("qwen3", False) else tiny_hf_model(seed=31, **shape)
    path = (save_gguf(hf, str(tmp_path / "m.gguf"), "Q8_0") if quantization == "gguf"
            else save_hf_dir(hf, str(tmp_path / "m")))
    expected = full_logits(LoadedModel(path, dtype="float32", quantization=quantization).model, IDS)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_logits, args=(r, tp, port, path, quantization, out)) for r in range(tp)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in range(tp))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank in range(tp):
        # gguf: split inputs sum their int8 block products in another order
        tol = 1e-5 if quantization == "none" else 1e-4
        torch.testing.assert_close(torch.from_numpy(results[rank]), expected, atol=tol, rtol=tol)
