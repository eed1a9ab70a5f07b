"""Tensor-parallel layers at tp = 2 and 4 (gloo, one process per rank) give tp = 1's logits.

The engine does not launch parallel workers yet; this checks the sharded weight loaders, the all-reduce in
the row-parallel layers, kv-head replication and the vocab-parallel embedding and LM head."""
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import save_hf_dir, tiny_hf_model

IDS = list(range(3, 40))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_logits(rank: int, world: int, port: int, path: str, out):
    from qwenserve.model.loader.checkpoint import open_checkpoint
    from qwenserve.model.loader.model_loader import load_model
    from qwenserve.model.parallel import TensorParallel
    from qwenserve.worker.model_runner import full_logits

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = load_model(open_checkpoint(path), torch.float32, 256, TensorParallel(rank, world, dist.group.WORLD))
        logits = full_logits(model, IDS)
        out.put((rank, logits.numpy()))  # by value: a shared tensor dies with this process
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tp,shape", [
    (2, dict(num_attention_heads=4, num_key_value_heads=2)),  # kv heads split
    (2, dict(num_attention_heads=4, num_key_value_heads=1)),  # one kv head, replicated
    (4, dict(num_attention_heads=4, num_key_value_heads=2, vocab_size=322)),  # replicated; uneven vocab shards
    (2, dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
])
def test_tensor_parallel_logits_equal_single_process(tmp_path, tp, shape):
    from qwenserve.model.loader.model_loader import LoadedModel
    from qwenserve.worker.model_runner import full_logits

    path = save_hf_dir(tiny_hf_model(seed=31, **shape), str(tmp_path / "m"))
    expected = full_logits(LoadedModel(path, dtype="float32").model, IDS)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_logits, args=(r, tp, port, path, out)) for r in range(tp)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in range(tp))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank in range(tp):
        torch.testing.assert_close(torch.from_numpy(results[rank]), expected, atol=1e-5, rtol=1e-5)
