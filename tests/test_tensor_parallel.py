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
