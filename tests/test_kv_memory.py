"""The KV cache's memory grows with use: the cache is reserved without touching its pages (resident memory,
measured in a fresh process, follows the blocks handed out), the allocator hands out used blocks before fresh
ones and fresh ones lowest id first, "auto" is bounded by what max_num_seqs full sequences could hold, and the
figures (weights, KV reserved, KV touched) add up."""
import json
import os
import subprocess
import sys

import pytest
import torch

from qwenserve.config.engine_config import EngineConfig
from qwenserve.core.kv_cache_manager import KVCacheManager
from qwenserve.core.request import Sequence
from qwenserve.engine.llm_engine import LLMEngine
from qwenserve.model.layers.attention import PagedKVCache, untouched_zeros
from qwenserve.sample.sampling_params import SamplingParams
from qwenserve.worker.memory import available_memory, kv_cache_budget, model_weights_bytes

from helpers import save_hf_dir, tiny_hf_model

BLOCK = 4
MiB = 1 << 20


# ---- the allocator ------------------------------------------------------------------------------------------

def _seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=str(seq_id), index=0, token_ids=list(tokens),
                    num_prompt_tokens=len(tokens), params=SamplingParams())


def _allocated(kv: KVCacheManager, seq: Sequence) -> Sequence:
    """seq's whole prompt given blocks (with its cached prefix, if any), as the scheduler admits it."""
    cached = kv.find_cached_prefix(seq)
    assert kv.allocate(seq, seq.num_tokens - len(cached) * BLOCK, cached)
    seq.num_computed_tokens = seq.num_tokens
    return seq


def test_fresh_blocks_come_lowest_id_first_and_only_when_no_used_block_is_free():
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK, enable_prefix_caching=False, bytes_per_block=1000)
    assert kv.num_touched == 0 and kv.touched_bytes == 0 and kv.reserved_bytes == 64_000
    a = _allocated(kv, _seq(1, range(100, 112)))  # 3 blocks
    b = _allocated(kv, _seq(2, range(200, 208)))  # 2 blocks
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4]
    assert kv.num_touched == 5 and kv.touched_bytes == 5000 and kv.num_free_blocks == 59
    kv.free_sequence(a)
    c = _allocated(kv, _seq(3, range(300, 312)))  # reuses a's blocks
    assert sorted(c.block_table) == [0, 1, 2] and kv.num_touched == 5
    d = _allocated(kv, _seq(4, range(400, 404)))  # every used block is live: the next fresh id
    assert d.block_table == [5] and kv.num_touched == 6 and kv.touched_bytes == 6000
    kv.check_invariants([b, c, d])
    for seq in (b, c, d):
        kv.free_sequence(seq)
    assert kv.num_free_blocks == 64 and kv.num_touched == 6  # touched pages stay resident: the mark never drops
    kv.check_invariants([])


def test_blocks_without_a_cached_prefix_are_reused_before_cached_ones():
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK)
    prompt = list(range(10, 20))  # 2 full blocks, cached, and a partial one that is not
    first = _allocated(kv, _seq(1, prompt))
    table = list(first.block_table)
    kv.free_sequence(first)
    other = _allocated(kv, _seq(2, [7, 7]))  # one block: the partial one, not a cached one
    assert other.block_table == [table[2]]
    again = _seq(3, prompt)
    assert kv.find_cached_prefix(again) == table[:2]  # the prefix survived
    _allocated(kv, again)
    assert kv.hits == 2 * BLOCK and again.block_table == table[:2] + [3]  # its own tail: the next fresh id
    kv.check_invariants([other, again])


def test_the_prefix_cache_keeps_as_many_blocks_as_the_peak_in_use():
    """Cached prefixes are kept, fresh blocks touched instead, while fewer are cached than the most blocks ever live
    at once; past that a new prompt evicts the least recently freed prefix blocks."""
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK)
    a = _allocated(kv, _seq(1, range(40, 56)))  # 4 full blocks
    c = _allocated(kv, _seq(2, range(60, 68)))  # 2 more: 6 live at the peak
    assert (a.block_table, c.block_table, kv.peak_live) == ([0, 1, 2, 3], [4, 5], 6)
    kv.free_sequence(a)  # 4 cached blocks free, fewer than 6
    b = _allocated(kv, _seq(3, range(80, 88)))
    assert b.block_table == [6, 7] and kv.num_touched == 8
    a_again = list(range(40, 56)) + [1]
    assert kv.find_cached_prefix(_seq(4, a_again)) == [0, 1, 2, 3]  # a's prefix is whole
    kv.free_sequence(c)
    kv.free_sequence(b)  # 8 cached blocks free: as many as the peak, so the next prompt evicts
    d = _allocated(kv, _seq(5, range(90, 98)))
    assert d.block_table == [3, 2] and kv.num_touched == 8  # a's tail, freed first
    assert kv.find_cached_prefix(_seq(6, a_again)) == [0, 1]
    kv.check_invariants([d])


def test_bytes_per_block_is_checked():
    with pytest.raises(ValueError, match="bytes_per_block"):
        KVCacheManager(num_blocks=4, block_size=BLOCK, bytes_per_block=-1)


# ---- the cache tensors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_cache_tensors_are_zero_contiguous_page_aligned_and_writable(dtype):
    cache = PagedKVCache(num_layers=2, num_blocks=5, block_size=BLOCK, num_kv_heads=2, head_dim=8, dtype=dtype)
    quantized = dtype.itemsize == 1
    tensors = cache.k + cache.v + (cache.k_scales + cache.v_scales if quantized else [])
    assert len({t.data_ptr() for t in tensors}) == len(tensors)  # no two share memory
    for t in tensors:
        assert t.is_contiguous() and t.data_ptr() % 4096 == 0 and not t.any()
    assert cache.k[0].shape == (5, BLOCK, 2, 8) and cache.k[0].dtype == dtype
    if quantized:
        assert cache.k_scales[1].shape == (5, BLOCK, 2)
    k = torch.randn(3, 2, 8, dtype=torch.bfloat16)
    cache.write(1, torch.tensor([0, 5, 19]), k, -k)  # block 0 slot 0, block 1 slot 1, block 4 slot 3
    keys, values = cache.gather(1, torch.tensor([[0, 1, 4]]), 3 * BLOCK, torch.bfloat16)
    tolerance = 0.05 if quantized else 0.0
    torch.testing.assert_close(keys[0, :, [0, 5, 11]].transpose(0, 1), k, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(values[0, :, [0, 5, 11]].transpose(0, 1), -k, atol=tolerance, rtol=tolerance)
    assert not cache.k[0].any() and not keys[0, :, [1, 2, 3, 4, 6]].any()  # the rest still reads as zeros


def test_untouched_zeros_on_a_device_without_mappings_is_plain_zeros():
    (t,) = untouched_zeros([((3, 4), torch.float32)], torch.device("meta"))
    assert t.device.type == "meta" and t.shape == (3, 4)


# ---- sizes and figures --------------------------------------------------------------------------------------

def test_auto_budget_is_bounded_by_what_can_be_used_and_an_explicit_size_is_kept():
    cpu = torch.device("cpu")
    assert kv_cache_budget("auto", cpu, 1, most_usable=12345) == 12345
    unbounded = kv_cache_budget("auto", cpu, 1, most_usable=1 << 50)
    assert 0 < unbounded < available_memory(cpu)
    assert kv_cache_budget(3 * MiB, cpu, 1, most_usable=12345) == 3 * MiB


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_hf_dir(tiny_hf_model(seed=71), str(tmp_path_factory.mktemp("kvmem")))


def test_auto_kv_size_is_max_num_seqs_full_sequences(tiny_path):
    engine = LLMEngine(EngineConfig.from_kwargs(model=tiny_path, dtype="float32", max_num_seqs=3, max_model_len=40,
                                                block_size=16))
    try:
        # tiny_hf_model: 2 layers, 2 kv heads, head_dim 16, float32: K and V of 16 tokens
        per_block = 2 * 2 * 16 * 2 * 16 * 4
        assert engine.executor.kv_block_bytes == per_block
        assert engine.kv.num_blocks == 3 * 3  # 3 sequences of ceil(40 / 16) blocks
        assert engine.kv_cache_budget == engine.kv.reserved_bytes == 9 * per_block
        model = engine.executor.worker.model
        dense = sum(p.numel() * p.element_size() for p in model.parameters())
        assert engine.weights_bytes == model_weights_bytes(model) >= dense > 0
        stats = engine.stats()
        assert (stats["weights_bytes"], stats["kv_reserved_bytes"], stats["kv_touched_bytes"]) == (
            engine.weights_bytes, 9 * per_block, 0)
        engine.add_request("a", list(range(20)), SamplingParams(max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.stats()["kv_touched_bytes"] == 2 * per_block  # 23 tokens computed: 2 blocks
    finally:
        engine.shutdown()


def test_explicit_kv_size_keeps_its_meaning(tiny_path):
    engine = LLMEngine(EngineConfig.from_kwargs(model=tiny_path, dtype="float32", max_num_seqs=3, max_model_len=40,
                                                block_size=16, kv_cache_memory="64KiB"))
    try:
        assert engine.kv_cache_budget == 64 * 1024  # as given, though the blocks stay within the bound
        assert engine.kv.num_blocks == min(64 * 1024 // engine.executor.kv_block_bytes, 9)
    finally:
        engine.shutdown()


# ---- resident memory, measured in a fresh process -------------------------------------------------------------

_MEASURE = r"""
import json, sys
from qwenserve import LLM, SamplingParams

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

def mapping_rss(address):
    # the resident bytes of the mapping that holds address (/proc/self/smaps)
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                inside = start <= address < end
            elif inside and fields[0] == "Rss:":
                return int(fields[1]) * 1024

def run(llm, first_token, max_tokens):
    # 32 sequences at once, 16 prompt tokens each, all different: no shared prefix
    prompts = [[first_token, i] + [(i * 7 + j) % 300 for j in range(14)] for i in range(32)]
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                 use_tqdm=False)
    return {"rss": rss(), "cache_rss": mapping_rss(cache), "touched": llm.engine.kv.num_touched}

before = rss()
# prefix caching off: the blocks touched are then exactly the most live at once (with it, the prefix cache may
# keep as many again, tests above)
llm = LLM(sys.argv[1], dtype="float32", kv_cache_memory="2GiB", enable_prefix_caching=False)
built = rss()
cache = llm.engine.executor.worker.kv_cache.k[0].data_ptr()
runs = [{"rss": built, "cache_rss": mapping_rss(cache), "touched": 0}]
for first_token, max_tokens in enumerate(sys.argv[2:]):
    runs.append(run(llm, first_token + 1, int(max_tokens)))
kv = llm.engine.kv
print(json.dumps({"before": before, "runs": runs, "num_blocks": kv.num_blocks, "bytes_per_block": kv.bytes_per_block,
                  "reserved": kv.reserved_bytes, "touched_bytes": kv.touched_bytes}))
"""


@pytest.mark.multiproc
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status and /proc/self/smaps")
def test_resident_memory_follows_the_blocks_used(tmp_path):
    # 8 layers of 8 kv heads of 64: 512 KiB a block of 16 tokens in float32 (32 KiB, whole pages, in each of the
    # layers' K and V tensors), so the blocks dominate what a step allocates beside them
    hf = tiny_hf_model(seed=72, hidden_size=512, num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=8,
                       intermediate_size=128, max_position_embeddings=1024)
    path = save_hf_dir(hf, str(tmp_path / "m"))
    # 32 sequences of 16 prompt tokens, then 16 + 15 computed: 2 blocks each; 16 + 47: 4 blocks each, twice
    result = subprocess.run([sys.executable, "-c", _MEASURE, path, "16", "48", "48"], capture_output=True, text=True,
                            timeout=900, env=os.environ | {"PYTHONWARNINGS": "ignore"})
    assert result.returncode == 0, result.stderr[-3000:]
    m = json.loads(result.stdout.strip().splitlines()[-1])
    built, small, large, again = m["runs"]
    per_block = m["bytes_per_block"]
    assert per_block == 2 * 8 * 16 * 8 * 64 * 4
    assert m["reserved"] == m["num_blocks"] * per_block == 2 << 30
    # building the engine (weights, about 40 MB, and the runtime) touches almost none of the 2 GiB reserved
    assert built["rss"] - m["before"] < m["reserved"] / 8, m
    assert built["cache_rss"] == 0, m
    # the blocks used, all sequences live at once, and no more: used blocks are reused before fresh ones
    assert (small["touched"], large["touched"], again["touched"]) == (32 * 2, 32 * 4, 32 * 4)
    assert m["touched_bytes"] == large["touched"] * per_block
    # the cache's own pages: exactly the touched blocks (up to a 2 MiB huge page in each of the 16 tensors)
    for run in (small, large, again):
        assert run["touched"] * per_block <= run["cache_rss"] <= run["touched"] * per_block + 16 * 2 * MiB, m
    # the whole process grows by about as much, and not at all for the same traffic again
    expected = (large["touched"] - small["touched"]) * per_block  # 32 MiB
    assert 0.8 * expected < large["rss"] - small["rss"] < 1.2 * expected + 8 * MiB, m
    assert again["rss"] - large["rss"] < 0.2 * expected, m
    print("RSS MiB: before the engine {:.0f}, built {:.0f}, after traffic {:.0f} / {:.0f} / {:.0f}; KV cache pages "
          "{:.0f} / {:.0f} / {:.0f} of {:.0f} reserved".format(
              m["before"] / MiB, *(r["rss"] / MiB for r in (built, small, large, again)),
              *(r["cache_rss"] / MiB for r in (small, large, again)), m["reserved"] / MiB))
