"""The engine over worker processes (tensor and pipeline parallel, `mp` executor): the same greedy tokens as
one process and as HF transformers; pipeline steps in flight; a dead worker fails requests instead of
hanging; no worker outlives the engine, even one killed with SIGKILL."""
import argparse
import logging
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwenserve import LLM, SamplingParams
from qwenserve.config.engine_config import EngineConfig
from qwenserve.config.errors import ConfigError
from qwenserve.config.model_config import ModelConfig
from qwenserve.distributed.groups import free_port
from qwenserve.distributed.layout import check_parallel_layout
from qwenserve.distributed.partition import balanced_partition
from qwenserve.distributed.pipeline import PipelineParallel
from qwenserve.executor.abstract import ExecutorDeadError
from qwenserve.entrypoints.cli.engine_args import add_engine_args, engine_config_from_args
from qwenserve.executor.shm_queue import ShmQueue
from qwenserve.model.models.qwen2 import Qwen2ForCausalLM

from helpers import (
    generate_until_killed,
    PROMPTS,
    greedy_tokens,
    hf_config,
    pid_alive,
    pids_gone,
    save_gguf,
    save_hf_dir,
    tiny_hf_model,
)


@pytest.mark.multiproc
@pytest.mark.parametrize("tp,pp,extra", [
    (2, 1, {}),
    (1, 2, {}),
    (2, 2, {}),
    # chunked prefill and a step budget that splits the batch: more steps in flight, more interleavings
    (1, 2, dict(max_num_batched_tokens=16)),
])
def test_greedy_tokens_equal_one_process(parallel_tiny, single_process_tokens, tp, pp, extra):
    _, path = parallel_tiny
    llm = LLM(path, dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp, **extra)
    try:
        assert llm.engine.executor.max_concurrent_batches == pp
        assert greedy_tokens(llm) == single_process_tokens
        # a seeded sampled request draws the same tokens in every layout (the generator lives with the sampler)
        seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8)
        one_process = LLM(path, dtype="float32")
        assert greedy_tokens(llm, PROMPTS[:2], seeded) == greedy_tokens(one_process, PROMPTS[:2], seeded)
        # the ranks' KV blocks (kv heads, layers) add up to one process's; their weights to at least as much
        # (what every tensor rank holds whole, such as the norms, counts once a rank)
        assert llm.engine.kv.bytes_per_block == one_process.engine.kv.bytes_per_block
        assert llm.engine.weights_bytes >= one_process.engine.weights_bytes
    finally:
        llm.engine.shutdown()
    assert pids_gone([p.pid for p in llm.engine.executor._procs], timeout=5)


@pytest.mark.multiproc
@pytest.mark.parametrize("fmt", ["hf-tied", "gguf"])
def test_pipeline_stages_load_only_their_part(tmp_path, fmt):
    """A tied LM head on a last stage without the embedding loads its own copy; GGUF blocks stay blocks."""
    hf = tiny_hf_model(seed=62, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=fmt == "hf-tied")
    path = (save_hf_dir(hf, str(tmp_path / "m")) if fmt == "hf-tied"
            else save_gguf(hf, str(tmp_path / "m.gguf"), "Q8_0"))
    expected = greedy_tokens(LLM(path, dtype="float32"), PROMPTS[:3])
    llm = LLM(path, dtype="float32", pipeline_parallel_size=2)
    try:
        assert greedy_tokens(llm, PROMPTS[:3]) == expected
    finally:
        llm.engine.shutdown()


def test_stage_layer_ranges_partition_the_model():
    config = ModelConfig.from_hf_dict(hf_config(num_hidden_layers=5).to_dict())
    owned = []
    for rank in range(2):
        model = Qwen2ForCausalLM(config, 64, pp=PipelineParallel(rank, 2))
        names = [n for n, _ in model.named_parameters()]
        layers = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
        assert layers == set(range(model.model.start_layer, model.model.end_layer))
        assert any(n.startswith("model.embed_tokens") for n in names) == (rank == 0)
        assert any(n.startswith(("lm_head", "model.norm")) for n in names) == (rank == 1)
        owned.append(layers)
    assert owned[0] | owned[1] == set(range(5)) and not owned[0] & owned[1]


def test_layer_partition_balances_the_head():
    assert balanced_partition(24, 2) == (12, 12)
    assert balanced_partition(24, 2, 1.0, 9.0) == (17, 7)  # the 0.5B model's LM head weighs ~9 layers
    assert balanced_partition(5, 2) == (3, 2)
    with pytest.raises(ValueError, match="more than the model's 2 layers"):
        balanced_partition(2, 3)
    with pytest.raises(ValueError, match="does not give each"):
        PipelineParallel(0, 2, layer_partition=(4, 0)).layer_range(4)


def test_layer_partition_and_ray_cpus_are_flags_and_keywords_validated():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    parallel = engine_config_from_args(parser.parse_args(
        ["--pipeline-parallel-size", "2", "--pp-layer-partition", "14,10", "--ray-cpus-per-worker", "3"])).parallel
    assert (parallel.pp_layer_partition, parallel.ray_cpus_per_worker) == ((14, 10), 3)
    defaults = EngineConfig.from_kwargs().parallel
    assert (defaults.pp_layer_partition, defaults.ray_cpus_per_worker) == (None, 1)
    assert EngineConfig.from_kwargs(pipeline_parallel_size=2, pp_layer_partition=[3, 1]).parallel.pp_layer_partition \
        == (3, 1)
    for value, message in [("14;10", r"pp_layer_partition '14;10' is not a comma-separated list of layer counts"),
                           ("14,0", r"pp_layer_partition '14,0' gives a stage no layers"),
                           ("24", r"pp_layer_partition '24' gives 1 stages, but pipeline_parallel_size is 2"),
                           (2.5, r"pp_layer_partition 2.5 is not a list of layer counts")]:
        with pytest.raises(ConfigError, match=message):
            EngineConfig.from_kwargs(pipeline_parallel_size=2, pp_layer_partition=value)
    for value in (0, "two", True):
        with pytest.raises(ConfigError, match=f"ray_cpus_per_worker must be a positive integer, got {value!r}"):
            EngineConfig.from_kwargs(ray_cpus_per_worker=value)


def test_layer_partition_reaches_every_stage(tmp_path, capfd):
    """The partition travels to the workers in the config: each stage loads the layers it names, and a partition
    that does not fit the model is refused before any worker starts."""
    hf = tiny_hf_model(seed=63, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4)
    path = save_hf_dir(hf, str(tmp_path / "m"))
    expected = greedy_tokens(LLM(path, dtype="float32"), PROMPTS[:2])
    qwenserve_logger = logging.getLogger("qwenserve")
    level = qwenserve_logger.level
    qwenserve_logger.setLevel(logging.INFO)  # the workers log at the engine's level
    try:
        llm = LLM(path, dtype="float32", pipeline_parallel_size=2, pp_layer_partition="3,1")
    finally:
        qwenserve_logger.setLevel(level)
    try:
        assert greedy_tokens(llm, PROMPTS[:2]) == expected
    finally:
        llm.engine.shutdown()
    logs = capfd.readouterr().err
    assert "pipeline stage 0 of 2: layers 0-2" in logs and "pipeline stage 1 of 2: layers 3-3" in logs, logs
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    with pytest.raises(ValueError, match=r"layer partition \[3, 2\] does not give each of 2 pipeline stages at least "
                                         r"one of the model's 4 layers"):
        check_parallel_layout(config, 1, 2, (3, 2))
    with pytest.raises(ValueError, match=r"layer partition \[3, 2\]"):
        LLM(path, dtype="float32", pipeline_parallel_size=2, pp_layer_partition="3,2")
    with pytest.raises(ValueError, match=r"layer partition \[3\] does not give each of 1 pipeline stages"):
        LLM(path, dtype="float32", pp_layer_partition="3")  # one stage in this process: checked all the same


def test_bad_parallel_settings_are_named(parallel_tiny, monkeypatch):
    _, path = parallel_tiny
    with pytest.raises(ConfigError, match="tensor_parallel_size must be a positive integer"):
        LLM(path, tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="distributed_executor_backend 'slurm'"):
        LLM(path, distributed_executor_backend="slurm")
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide num_attention_heads 4"):
        LLM(path, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="pipeline_parallel_size 9 is more than the model's 2 layers"):
        LLM(path, pipeline_parallel_size=9)
    with pytest.raises(ConfigError, match="gives 1 CPU sets for 2 ranks"):
        LLM(path, tensor_parallel_size=2, cpu_omp_threads_bind="0-1")
    with pytest.raises(ConfigError, match="gives 2 CPU sets for 4 ranks"):  # every replica's processes
        LLM(path, tensor_parallel_size=2, data_parallel_size=2, cpu_omp_threads_bind="0|1")
    with pytest.raises(ConfigError, match="'x' is not a list of CPUs"):
        LLM(path, tensor_parallel_size=2, cpu_omp_threads_bind="0|x")
    monkeypatch.setenv("QWENSERVE_CPU_OMP_THREADS_BIND", "0-1")  # the variable gives the default
    with pytest.raises(ConfigError, match="gives 1 CPU sets for 2 ranks.*QWENSERVE_CPU_OMP_THREADS_BIND='0-1'"):
        LLM(path, tensor_parallel_size=2)


def test_cpu_sets_for_ranks_follow_the_setting():
    from qwenserve.worker.cpu_tuning import cpu_sets_for_ranks
    assert cpu_sets_for_ranks(2, "0-1|2,4") == [{0, 1}, {2, 4}]
    assert cpu_sets_for_ranks(3, "all") == [None, None, None]
    assert len(cpu_sets_for_ranks(2)) == 2  # by default: this process's CPUs shared out


@pytest.mark.multiproc
def test_worker_start_failure_is_raised_in_the_engine(parallel_tiny, tmp_path):
    """A checkpoint that breaks in the worker (a tensor of the wrong shape) raises the worker's error here."""
    hf, path = parallel_tiny
    bad = save_hf_dir(hf, str(tmp_path / "bad"))
    shard = next(f for f in os.listdir(bad) if f.endswith(".safetensors"))
    tensors = load_file(os.path.join(bad, shard))
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()
    save_file(tensors, os.path.join(bad, shard), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.norm.weight"):
        LLM(bad, dtype="float32", pipeline_parallel_size=2)


@pytest.mark.multiproc
def test_killed_worker_fails_requests_within_seconds(parallel_tiny):
    _, path = parallel_tiny
    llm = LLM(path, dtype="float32", tensor_parallel_size=2, max_num_seqs=2)
    pids = [p.pid for p in llm.engine.executor._procs]
    error, seconds = generate_until_killed(llm, pids[1])
    assert isinstance(error, ExecutorDeadError)
    assert "worker rank 1" in str(error) and "-9" in str(error)
    assert seconds < 5
    assert pids_gone(pids, timeout=10)
    with pytest.raises(ExecutorDeadError):  # and it stays dead, saying why
        greedy_tokens(llm, PROMPTS[:1])


@pytest.mark.multiproc
def test_no_worker_outlives_an_engine_killed_with_sigkill(parallel_tiny, tmp_path):
    _, path = parallel_tiny
    script = tmp_path / "engine.py"
    # no __main__ guard, as many users write it: the workers must not rerun it
    script.write_text(textwrap.dedent(f"""
        import time
        from qwenserve import LLM
        llm = LLM({path!r}, dtype="float32", tensor_parallel_size=2)
        print(" ".join(str(p.pid) for p in llm.engine.executor._procs), flush=True)
        time.sleep(600)
    """))
    # stderr: its resource tracker reports the shared memory it cleaned up after the kill
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(pid_alive(p) for p in pids)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert pids_gone(pids, timeout=10), "a worker outlived its engine"
    finally:
        proc.kill()


def test_shm_queue_carries_large_messages_to_every_reader():
    ctx = multiprocessing.get_context("spawn")
    q = ShmQueue(ctx, num_readers=2, num_slots=3, slot_bytes=64)
    readers = [q.reader(0), q.reader(1)]
    messages = [{"i": i, "blob": list(range(i * 40))} for i in range(6)]  # up to ~8 slots each
    got = [[], []]

    def read(r):
        for _ in messages:
            got[r].append(readers[r].get(timeout=10))

    threads = [threading.Thread(target=read, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for m in messages:
        q.put(m)  # blocks while a reader is a whole ring behind
    for t in threads:
        t.join(timeout=10)
    assert got == [messages, messages]
    with pytest.raises(queue.Empty):
        readers[0].get(timeout=0.05)
    q.close()


@pytest.mark.multiproc
def test_server_answers_5xx_and_turns_unhealthy_when_a_worker_dies(parallel_tiny):
    import asyncio

    import httpx

    from qwenserve.config.engine_config import EngineConfig
    from qwenserve.engine.async_engine import AsyncLLMEngine
    from qwenserve.engine.llm_engine import LLMEngine
    from qwenserve.entrypoints.openai.api_server import build_app

    _, path = parallel_tiny
    # one sequence at a time: the later requests are still waiting or running when the worker dies
    engine = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=path, dtype="float32", tensor_parallel_size=2,
                                                               max_num_seqs=1)))
    app = build_app(engine, ["parallel_tiny"])
    pids = [p.pid for p in engine.engine.executor._procs]

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=60) as c:
            assert (await c.get("/health")).status_code == 200
            body = {"prompt": [5, 6, 7], "max_tokens": 250, "ignore_eos": True, "temperature": 0}
            pending = asyncio.gather(*[c.post("/v1/completions", json=body) for _ in range(8)])
            deadline = time.monotonic() + 30
            while (stats := await engine.stats())["running"] != 1 or stats["waiting"] != 7:  # all in, one decoding
                assert time.monotonic() < deadline, f"the requests did not all arrive: {stats}"
                await asyncio.sleep(0.02)
            os.kill(pids[0], signal.SIGKILL)
            failed = (await asyncio.wait_for(pending, timeout=10))[-1]
            later = await c.post("/v1/completions", json={**body, "max_tokens": 2})
            return failed, later, await c.get("/health")
    try:
        failed, later, health = asyncio.run(main())
    finally:
        engine.shutdown()
    assert failed.status_code >= 500 and "worker rank 0" in failed.json()["error"]["message"]
    assert later.status_code >= 500 and later.json()["error"]["message"]
    assert health.status_code == 503
    assert pids_gone(pids, timeout=10)


def _shm_rank(rank, world, port, out):
    from qwenserve.distributed.groups import init_model_parallel
    tp, _ = init_model_parallel(rank, world, 1, f"tcp://127.0.0.1:{port}", "gloo", shm_name=f"qwenserve-test-{port}")
    assert tp.shm is not None
    results = []
    for dtype, n in [(torch.float32, 5), (torch.bfloat16, 300_001)]:  # the second spans several chunks
        x = torch.Generator().manual_seed(rank)
        x = torch.randn(n, generator=x).to(dtype)
        results.append(tp.all_reduce(x.clone()).float().numpy())
        strided = torch.randn(6, 8, generator=torch.Generator().manual_seed(10 + rank)).to(dtype)[:, ::2]
        results.append(tp.all_reduce(strided).float().numpy())  # not contiguous: reduced in place all the same
    out.put((rank, results))


@pytest.mark.multiproc
def test_shm_all_reduce_sums_in_rank_order_on_every_rank():
    world = 3
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_shm_rank, args=(r, world, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    i = 0
    for dtype, n in [(torch.float32, 5), (torch.bfloat16, 300_001)]:
        parts = [torch.randn(n, generator=torch.Generator().manual_seed(r)).to(dtype) for r in range(world)]
        expected = parts[0].clone()
        for part in parts[1:]:
            expected.add_(part)
        strided = [torch.randn(6, 8, generator=torch.Generator().manual_seed(10 + r)).to(dtype)[:, ::2]
                   for r in range(world)]
        expected_strided = strided[0] + strided[1] + strided[2]
        for rank in range(world):  # the same bits everywhere: ranks sample from these
            assert torch.equal(torch.from_numpy(got[rank][i]), expected.float())
            assert torch.equal(torch.from_numpy(got[rank][i + 1]), expected_strided.float())
        i += 2
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"qwenserve-test-{port}")]


def test_rendezvous_ports_come_from_below_the_ephemeral_range(monkeypatch, tmp_path):
    """The rendezvous port is one outgoing connections are never handed (they draw from the ephemeral range), so
    it stays free until rank 0 listens on it; a range with no room below falls back to the kernel's choice."""
    import socket

    from qwenserve.distributed import groups
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("32768\t60999\n")
    monkeypatch.setattr(groups, "_EPHEMERAL_RANGE", str(ranges))
    for _ in range(20):
        port = free_port()
        assert 20000 <= port < 32768
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))  # free: binds
    ranges.write_text("1024\t65535\n")
    assert 0 < free_port() < 65536
