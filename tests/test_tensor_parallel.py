"""Tensor-parallel layers at tp = 2 and 4 (gloo, one process per rank) give tp = 1's logits.

The layers alone, outside the engine (whose worker processes test_distributed.py runs): the sharded weight
loaders, the all-reduce in the row-parallel layers, kv-head replication and the vocab-parallel embedding and
LM head."""
import pytest
import torch

from helpers import save_gguf, save_hf_dir, tensor_parallel_logits, tiny_hf_model, tiny_qwen3

pytestmark = pytest.mark.multiproc

IDS = list(range(3, 40))


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
    results = tensor_parallel_logits(path, tp, IDS, quantization)
    for rank in range(tp):
        # gguf: split inputs sum their int8 block products in another order
        tol = 1e-5 if quantization == "none" else 1e-4
        torch.testing.assert_close(torch.from_numpy(results[rank]), expected, atol=tol, rtol=tol)


def test_a_rank_checks_the_whole_checkpoint_tensor_before_keeping_its_part():
    """Every rank reads each checkpoint tensor whole and keeps its part: q, k and v at 4 ranks over 2 kv heads (each kv
    head a replica on two ranks), and a row-parallel layer's columns. A tensor of other extent than the config's is
    refused on every rank, though the rank's own part of it would fit."""
    from qwenserve.distributed.tensor_parallel import TensorParallel
    from qwenserve.model.layers.linear import QKVParallelLinear, RowParallelLinear
    q, k, v = torch.randn(64, 64), torch.randn(32, 64), torch.randn(32, 64)
    for rank in range(4):
        qkv = QKVParallelLinear(64, 16, 4, 2, bias=False, tp=TensorParallel(rank, 4))
        for shard, tensor in (("q", q), ("k", k), ("v", v)):
            qkv.weight_loader(qkv.weight, tensor, shard)
        kv_head = rank // 2
        assert torch.equal(qkv.weight, torch.cat([q[16 * rank:16 * (rank + 1)], k[16 * kv_head:16 * (kv_head + 1)],
                                                  v[16 * kv_head:16 * (kv_head + 1)]]))
        with pytest.raises(ValueError, match=r"QKVParallelLinear shard k: checkpoint tensor has shape \(48, 64\), the "
                                             r"model expects \(32, 64\)"):
            qkv.weight_loader(qkv.weight, torch.randn(48, 64), "k")
    down = torch.randn(64, 128)
    for rank in range(2):
        row = RowParallelLinear(128, 64, tp=TensorParallel(rank, 2))
        row.weight_loader(row.weight, down)
        assert torch.equal(row.weight, down[:, 64 * rank:64 * (rank + 1)])
        with pytest.raises(ValueError, match=r"RowParallelLinear: checkpoint tensor has shape \(64, 160\), the model "
                                             r"expects \(64, 128\)"):
            row.weight_loader(row.weight, torch.randn(64, 160))
