"""The engine over Ray actors (`ray` executor) on a real two-node cluster: a head and a second node started with
`ray start` on this machine, as a user starts them on two machines. The ranks are placed across both nodes;
greedy tokens equal one process's (and so HF's); a dead actor fails requests instead of hanging; no actor
outlives the engine."""
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from qwenserve import LLM, SamplingParams
from qwenserve.config.errors import ConfigError
from qwenserve.distributed.groups import free_port
from qwenserve.executor.abstract import ExecutorDeadError

from helpers import PROMPTS, generate_until_killed, greedy_tokens, pid_alive, pids_gone

pytestmark = pytest.mark.ray

RAY = shutil.which("ray", path=os.path.dirname(sys.executable))  # the venv's ray (qwenserve[ray])
NODE_CPUS = 2  # Ray's accounting only: the nodes share this machine's cores


def _ray(*args: str) -> None:
    subprocess.run([RAY, *args, "--disable-usage-stats"] if args[0] == "start" else [RAY, *args], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)


@pytest.fixture(scope="module")
def ray_cluster():
    """RAY_ADDRESS of a fresh cluster: a head node and a second node, NODE_CPUS each."""
    assert RAY, "ray is not installed in this environment: scripts/ensure_venv.sh installs qwenserve[ray]"
    import ray
    _ray("stop", "--force")
    address = f"127.0.0.1:{free_port()}"
    common = (f"--num-cpus={NODE_CPUS}", "--object-store-memory=100000000")
    _ray("start", "--head", f"--port={address.rsplit(':', 1)[1]}", "--include-dashboard=false", *common)
    _ray("start", f"--address={address}", *common)
    saved = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = address
    try:
        ray.init(address=address, logging_level="WARNING")
        deadline = time.time() + 30
        while len([n for n in ray.nodes() if n["Alive"]]) < 2:
            assert time.time() < deadline, "the second Ray node did not join"
            time.sleep(0.5)
        yield address
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = saved
        _ray("stop", "--force")


def _ray_llm(path, tp=1, pp=1, **extra) -> LLM:
    return LLM(path, dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp,
               distributed_executor_backend="ray", **extra)


def _pids(llm) -> list[int]:
    return [pid for _, _, pid in llm.engine.executor.rank_locations]


@pytest.mark.parametrize("tp,pp,cpus", [(2, 1, NODE_CPUS), (1, 2, NODE_CPUS), (2, 2, 1)])
def test_greedy_tokens_across_two_nodes(ray_cluster, parallel_tiny, single_process_tokens, tp, pp, cpus):
    # bundles as large as a node force a 2-rank world across both nodes; 4 ranks of one CPU fill both
    llm = _ray_llm(parallel_tiny[1], tp, pp, ray_cpus_per_worker=cpus)
    try:
        nodes = [node for node, _, _ in llm.engine.executor.rank_locations]
        assert len(set(nodes)) == 2, nodes
        assert llm.engine.executor.max_concurrent_batches == pp
        assert greedy_tokens(llm) == single_process_tokens
        seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8)
        assert greedy_tokens(llm, PROMPTS[:2], seeded) == greedy_tokens(
            LLM(parallel_tiny[1], dtype="float32"), PROMPTS[:2], seeded)
    finally:
        llm.engine.shutdown()
    assert pids_gone(_pids(llm), timeout=15), "an actor outlived shutdown"


def test_data_parallel_replicas_on_two_nodes(ray_cluster, parallel_tiny, single_process_tokens):
    # a replica fills a node: one on each
    llm = _ray_llm(parallel_tiny[1], data_parallel_size=2, ray_cpus_per_worker=NODE_CPUS)
    replicas = llm.engine.replicas
    try:
        assert len({r.executor.rank_locations[0][0] for r in replicas}) == 2
        assert greedy_tokens(llm) == single_process_tokens
        assert llm.engine.num_routed == [3, 3]
    finally:
        llm.engine.shutdown()
    assert pids_gone([pid for r in replicas for _, _, pid in r.executor.rank_locations], timeout=15)


def test_a_cluster_too_small_is_named_at_once(ray_cluster, parallel_tiny):
    started = time.time()
    with pytest.raises(ConfigError, match=r"cannot hold 2 workers of \{'CPU': 3.0\} each: it has CPU 4 of 6 needed "
                                          r"\(add nodes, or lower ray_cpus_per_worker\)"):
        _ray_llm(parallel_tiny[1], tp=2, ray_cpus_per_worker=3)
    assert time.time() - started < 10
    with pytest.raises(ConfigError, match="ray_cpus_per_worker must be a positive integer, got 'two'"):
        _ray_llm(parallel_tiny[1], tp=2, ray_cpus_per_worker="two")


def test_killed_actor_fails_requests_within_seconds(ray_cluster, parallel_tiny):
    llm = _ray_llm(parallel_tiny[1], tp=2, max_num_seqs=2)
    pids = _pids(llm)
    error, seconds = generate_until_killed(llm, pids[1])
    assert isinstance(error, ExecutorDeadError)
    assert "worker rank 1" in str(error)
    assert seconds < 5
    assert pids_gone(pids, timeout=15)
    with pytest.raises(ExecutorDeadError):
        greedy_tokens(llm, PROMPTS[:1])


def test_no_actor_outlives_an_engine_killed_with_sigkill(ray_cluster, parallel_tiny, tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent(f"""
        import time
        from qwenserve import LLM
        llm = LLM({parallel_tiny[1]!r}, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray")
        print(" ".join(str(pid) for _, _, pid in llm.engine.executor.rank_locations), flush=True)
        time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env={**os.environ, "RAY_ADDRESS": ray_cluster})
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(pid_alive(p) for p in pids)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert pids_gone(pids, timeout=30), "a Ray actor outlived its engine"
    finally:
        proc.kill()
