"""Engine settings: one validated object, shared by the Python API, the CLI and the server.

Each setting is declared once, as a field of one of the sections below, with its help text; the CLI's flags
(`--block-size`, ...) and `LLM(**kwargs)` are generated from those fields (see `EngineConfig.settings`). A setting
declared with `env=` takes its default from that environment variable when an entry point builds the config
(`EngineConfig.from_user_settings`; see environment.py)."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from qwenserve.config.cpu_variants import AUTO, VARIANTS, choose_variant
from qwenserve.config.dual_chunk_config import parse_hf_overrides
from qwenserve.config.environment import env_defaults
from qwenserve.config.errors import ConfigError
from qwenserve.config.model_config import resolve_kv_cache_dtype
from qwenserve.config.resolved_model import ResolvedModel
from qwenserve.config.speculative_config import SpeculativeConfig
from qwenserve.config.tuning import this_cpu_tuning

GiB = 1 << 30
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 10**6, "mb": 10**6, "mib": 1 << 20,
          "g": 10**9, "gb": 10**9, "gib": GiB, "t": 10**12, "tb": 10**12, "tib": 1 << 40}


def parse_size(value: int | str, name: str = "kv_cache_memory") -> int:
    """Bytes from an int or a string such as '2GiB', '512MiB', '1.5GB' or '1073741824'; name: the setting's, for
    the error."""
    if isinstance(value, int):
        return value
    m = _SIZE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{name} {value!r} is not a size (examples: 2GiB, 512MiB, 1073741824)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_layer_partition(value: str | tuple[int, ...] | list[int] | None,
                          num_stages: int) -> tuple[int, ...] | None:
    """Layers per pipeline stage from "14,10" or a sequence of ints; None or "" for the balanced split. Whether
    the counts add up to the model's layers is checked once the model is known (distributed/layout.py)."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            counts = tuple(int(part) for part in value.split(","))
        except ValueError:
            raise ConfigError(f"pp_layer_partition {value!r} is not a comma-separated list of layer counts "
                              f"(e.g. 14,10)") from None
    elif isinstance(value, (tuple, list)) and all(isinstance(n, int) and not isinstance(n, bool) for n in value):
        counts = tuple(value)
    else:
        raise ConfigError(f"pp_layer_partition {value!r} is not a list of layer counts (e.g. 14,10 or (14, 10))")
    if min(counts, default=0) < 1:
        raise ConfigError(f"pp_layer_partition {value!r} gives a stage no layers: every count must be at least 1")
    if len(counts) != num_stages:
        raise ConfigError(f"pp_layer_partition {value!r} gives {len(counts)} stages, but pipeline_parallel_size is "
                          f"{num_stages}")
    return counts


def setting(default, help: str, **cli):
    """A field that is also a CLI flag; `cli` may give `type` (the flag's parser and the variable's), `hidden` (no
    flag) or `env` (the environment variable that gives the default at the entry points)."""
    return field(default=default, metadata={"help": help, **cli})


def _check_positive(config, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class LoadConfig:
    """What to load and where it runs."""
    model: str | None = setting(None, "HF checkpoint directory or .gguf file "
                                      "(default: the bundled Qwen2.5-Coder-0.5B-Instruct)")
    dtype: str = setting("auto", "auto, float32, bfloat16 or float16 (default: %(default)s)")
    max_model_len: int | None = setting(None, "longest prompt + output in tokens "
                                              "(default: the model's max_position_embeddings)", type=int)
    device: str = setting("cpu", "torch device to run on: cpu or cuda[:N] (default: %(default)s)")
    quantization: str | None = setting(
        None, "how weights are held: none (dense, in dtype), gguf (a GGUF file's quantized blocks, run by our CPU "
              "kernels), int8 / int4 (quantized at load: int8 per output channel, int4 in groups of 128), fp8 "
              "(an FP8 checkpoint's e4m3 weights, or quantized at load in 128x128 blocks), awq, gptq or "
              "compressed-tensors (those checkpoints' own weights); default: gguf for a .gguf file, the "
              "quant_method of config.json's quantization_config, else none")
    cpu_kernels: bool = setting(True, "run on qwenserve's compiled CPU kernels (built at install; a failed build is "
                                      "an error); off: PyTorch ops only, several times slower (default: on)",
                                env="QWENSERVE_CPU_KERNELS")
    cpu_isa: str = setting(AUTO, "which build of the CPU kernels runs: auto (the best this CPU runs) or a variant "
                                 f"({', '.join(v.name for v in VARIANTS)}) this CPU runs, to compare CPU "
                                 "families on one machine (default: %(default)s)", env="QWENSERVE_CPU_ISA")
    enforce_eager: bool = setting(False, "run each decoder layer's modules one by one at decode, instead of one "
                                         "call of the compiled kernels for all the layers (the CPU's stand-in for a "
                                         "captured graph; same results), to compare or debug (default: off)",
                                  env="QWENSERVE_ENFORCE_EAGER")

    hf_overrides: dict | None = setting(
        None, "JSON object merged into the checkpoint's config.json (a nested object key by key) before it is read, "
              "as vLLM's flag: e.g. '{\"dual_chunk_attention_config\": {\"chunk_size\": 262144, \"local_size\": "
              "8192, \"original_max_position_embeddings\": 32768}}' turns on dual-chunk attention "
              "(docs/long_context.md) (default: none)", type=str)

    def __post_init__(self):
        choose_variant(self.cpu_isa)  # an unknown name, or a variant this CPU cannot run, fails here, not at load
        object.__setattr__(self, "hf_overrides", parse_hf_overrides(self.hf_overrides))


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = setting(16, "tokens per KV block (default: %(default)s)", type=int)
    kv_cache_memory: int | str = setting("auto", "KV cache memory of each worker process, e.g. 2GiB or bytes, or "
                                                 "auto: half of the memory available once the weights are loaded "
                                                 "(less 1 GiB kept for the processes), shared by this host's "
                                                 "workers, at most what max_num_seqs sequences of max_model_len "
                                                 "tokens fill; a tensor-parallel rank fills it with its share of the "
                                                 "kv heads (as vLLM gives each GPU its own). Reserved, not resident: "
                                                 "a block's pages take memory once it is first used (default: auto)",
                                         type=str)
    enable_prefix_caching: bool = setting(True, "reuse KV blocks of repeated prompt prefixes (default: on)")
    kv_cache_dtype: str = setting("auto", "KV cache storage: auto (the model's dtype), int8, fp8_e4m3 (or fp8) or "
                                          "fp8_e5m2 (one byte a value plus a scale per token and head: about twice "
                                          "the tokens in the same kv_cache_memory; a checkpoint's k_scale / v_scale "
                                          "replace the per-token scales) (default: %(default)s)")

    def __post_init__(self):
        if self.kv_cache_memory != "auto":
            object.__setattr__(self, "kv_cache_memory", parse_size(self.kv_cache_memory))
            _check_positive(self, "kv_cache_memory")
        _check_positive(self, "block_size")
        resolve_kv_cache_dtype(self.kv_cache_dtype)  # a bad name, or fp8 this torch lacks, fails here, not at load


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = setting(256, "sequences per step at most (default: %(default)s)", type=int)
    max_num_batched_tokens: int = setting(4096, "tokens per step at most; longer prompts are prefilled in chunks "
                                                "(default: %(default)s)", type=int)
    pipelined_step_tokens: int | None = setting(
        None, "tokens per step at most while several steps are in flight (pipeline parallel): smaller steps shorten "
              "the pipeline's fill and drain (default: this CPU's tuning table, config/tuning.py)", type=int)

    def __post_init__(self):
        if self.pipelined_step_tokens is None:
            object.__setattr__(self, "pipelined_step_tokens", this_cpu_tuning().pipelined_step_tokens)
        _check_positive(self, "max_num_seqs", "max_num_batched_tokens", "pipelined_step_tokens")


MM_MODALITIES = ("image", "video")


def parse_mm_limits(value: int | str | dict) -> dict[str, int]:
    """limit_mm_per_prompt's value -> {"image": n, "video": m}: an int (images), a dict, or its JSON
    ('{"image": 4, "video": 1}'); a modality not named keeps the default."""
    import json
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ConfigError(f"limit_mm_per_prompt {value!r} is neither a number nor JSON such as "
                              f'{{"image": 4}}') from None
    if isinstance(value, int) and not isinstance(value, bool):
        value = {"image": value}
    if not isinstance(value, dict):
        raise ConfigError(f"limit_mm_per_prompt {value!r} is not a number or a dict such as {{'image': 4}}")
    unknown = [k for k in value if k not in MM_MODALITIES]
    if unknown:
        raise ConfigError(f"limit_mm_per_prompt names {unknown}; supported: {', '.join(MM_MODALITIES)}")
    bad = {k: v for k, v in value.items() if not isinstance(v, int) or isinstance(v, bool) or v < 0}
    if bad:
        raise ConfigError(f"limit_mm_per_prompt {bad} must be non-negative integers")
    return {**{m: DEFAULT_MM_LIMIT for m in MM_MODALITIES}, **value}


DEFAULT_MM_LIMIT = 16


@dataclass(frozen=True)
class MultiModalConfig:
    """Images in prompts (vision-language models)."""
    limit_mm_per_prompt: int | str | dict = setting(
        DEFAULT_MM_LIMIT, 'most images (and videos) one prompt may hold: a number (images), or JSON such as '
                          '\'{"image": 4, "video": 1}\' '
                          "(default: %(default)s)", type=str)
    encoder_cache_memory: int | str = setting("256MiB", "memory of each worker for vision-tower outputs kept "
                                                        "between steps, so a prompt chunked across steps (or the "
                                                        "same image in another request) runs the tower once; least "
                                                        "recently used first out (default: %(default)s)", type=str)
    # remote URLs are off by default: a server that fetches any URL a client names can be made to reach
    # addresses only it can see
    allowed_media_domains: list[str] | None = setting(
        None, "hosts whose http(s) media URLs (image_url parts) are fetched, matched exactly, e.g. "
              "images.example.com; default: none (every remote URL is refused)", nargs="+", metavar="HOST")
    allowed_local_media_path: str | None = setting(
        None, "directory whose files file:// media URLs may name (default: none, file:// URLs are refused)")
    media_fetch_timeout: float = setting(5.0, "seconds one remote media URL may take to download (default: "
                                              "%(default)s)", type=float)
    max_media_bytes: int | str = setting("20MiB", "largest media file fetched or read for one content part "
                                                  "(default: %(default)s)", type=str)

    def __post_init__(self):
        object.__setattr__(self, "limit_mm_per_prompt", parse_mm_limits(self.limit_mm_per_prompt))
        object.__setattr__(self, "encoder_cache_memory", parse_size(self.encoder_cache_memory,
                                                                    "encoder_cache_memory"))
        object.__setattr__(self, "max_media_bytes", parse_size(self.max_media_bytes, "max_media_bytes"))
        if isinstance(self.allowed_media_domains, str):  # one host given as a string (LLM(allowed_media_domains=...))
            object.__setattr__(self, "allowed_media_domains", [self.allowed_media_domains])
        if not self.media_fetch_timeout > 0:
            raise ConfigError(f"media_fetch_timeout must be positive seconds, got {self.media_fetch_timeout!r}")
        if self.max_media_bytes < 1:
            raise ConfigError(f"max_media_bytes must be at least 1 byte, got {self.max_media_bytes!r}")


DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")
CPU_BIND_ALL = "all"


def parse_cpu_binding(text: str, num_ranks: int | None) -> list[set[int] | None]:
    """cpu_omp_threads_bind's CPU set for each of num_ranks processes ("0-3|4-7" -> [{0, 1, 2, 3}, {4, 5, 6, 7}]);
    "all" leaves each on every CPU (None). num_ranks None: check the syntax only."""
    text = text.strip()
    if text == CPU_BIND_ALL:
        return [None] * (num_ranks or 1)
    sets = [_parse_cpu_list(part, text) for part in text.split("|")]
    if num_ranks is not None and len(sets) != num_ranks:
        raise ConfigError(f"cpu_omp_threads_bind {text!r} gives {len(sets)} CPU sets for {num_ranks} ranks")
    return sets


def _parse_cpu_list(part: str, whole: str) -> set[int]:
    cpus: set[int] = set()
    try:
        for item in part.split(","):
            first, _, last = item.strip().partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise ConfigError(f"cpu_omp_threads_bind {whole!r}: {part!r} is not a list of CPUs such as 0-3 or 0,2"
                          ) from None
    return cpus


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over worker processes: tensor_parallel_size ranks share every layer,
    pipeline_parallel_size stages each own a contiguous range of layers; data_parallel_size whole copies of that
    (replicas) share the requests."""
    tensor_parallel_size: int = setting(1, "ranks that split every layer (heads, MLP columns, vocabulary) "
                                           "(default: %(default)s)", type=int)
    pipeline_parallel_size: int = setting(1, "stages that each hold a contiguous range of layers, with as many "
                                             "batches in flight (default: %(default)s)", type=int)
    data_parallel_size: int = setting(1, "engine replicas, each with its own workers and KV cache, that share "
                                         "the requests (routed by load and cached prefix) (default: %(default)s)",
                                      type=int)
    enable_expert_parallel: bool = setting(
        False, "place whole experts of a mixture-of-experts layer on the tensor-parallel ranks (each rank a "
               "contiguous range) instead of a slice of every expert on each; attention and dense layers stay "
               "split as before. No effect with tensor_parallel_size 1 or on a model without experts "
               "(default: off)")
    distributed_executor_backend: str | None = setting(
        None, "how the worker processes are started: mp (spawned on this host) or ray (actors of the Ray cluster "
              "at RAY_ADDRESS, or a local one; pip install qwenserve[ray]); default: mp when there is more than "
              "one process")
    pp_layer_partition: tuple[int, ...] | None = setting(
        None, "decoder layers of each pipeline stage, comma-separated, e.g. 14,10 (default: balanced by the weights "
              "each stage reads, so the last stage, which also runs the LM head, takes fewer)",
        type=str, env="QWENSERVE_PP_LAYER_PARTITION")
    ray_cpus_per_worker: int = setting(1, "CPUs each Ray worker reserves in the placement group and runs threads on "
                                          "(ray backend on CPU) (default: %(default)s)",
                                       type=int, env="QWENSERVE_RAY_CPUS_PER_WORKER")
    cpu_omp_threads_bind: str | None = setting(
        None, "the CPUs each worker process's threads run on (mp backend): one set per process, tensor x pipeline x "
              "data parallel of them in rank order, separated by '|', each a list of CPUs and ranges (0-3|4-7, "
              "0,2|1,3); all: every process on every CPU; default: this process's CPUs split evenly, in order",
        env="QWENSERVE_CPU_OMP_THREADS_BIND")

    def __post_init__(self):
        _check_positive(self, "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                        "ray_cpus_per_worker")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ConfigError(f"distributed_executor_backend {backend!r} is not one of "
                              f"{', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}")
        object.__setattr__(self, "pp_layer_partition",
                           parse_layer_partition(self.pp_layer_partition, self.pipeline_parallel_size))
        if self.cpu_omp_threads_bind is not None:
            # the mp executor binds every process on this host; elsewhere only the syntax can be checked here
            ranks = self.world_size * self.data_parallel_size if self.backend == "mp" else None
            parse_cpu_binding(self.cpu_omp_threads_bind, ranks)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def backend(self) -> str:
        """'uni' (the worker in the engine's process) or the backend that starts worker processes. Replicas
        always get worker processes: in the engine's process they would share its cores and its GIL."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "mp" if self.world_size > 1 or self.data_parallel_size > 1 else "uni"


@dataclass(frozen=True)
class LoRAConfig:
    """Serving PEFT LoRA adapters beside the base model, chosen per request (vLLM's flags)."""
    enable_lora: bool = setting(False, "serve LoRA adapters chosen per request (LLM.generate(..., lora_request=...); "
                                       "the server's --lora-modules) (default: off)")
    max_loras: int = setting(1, "distinct adapters in one batch at most; requests of others wait "
                                "(default: %(default)s)", type=int)
    max_lora_rank: int = setting(16, "the largest adapter rank (r) accepted; a larger one is a request error "
                                     "(default: %(default)s)", type=int)
    max_cpu_loras: int | None = setting(None, "adapters kept loaded in memory, least recently used evicted "
                                              "(default: max_loras)", type=int)

    def __post_init__(self):
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        _check_positive(self, "max_loras", "max_lora_rank", "max_cpu_loras")
        if self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras}): "
                              f"every adapter of a batch stays loaded")


@dataclass(frozen=True)
class EngineConfig:
    load: LoadConfig = field(default_factory=LoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    multimodal: MultiModalConfig = field(default_factory=MultiModalConfig)
    record_logits: bool = setting(False, "keep each sampled step's logits on the outputs (for compare and "
                                         "debugging; costly: full-vocabulary rows leave the worker)")
    speculative_config: SpeculativeConfig | None = setting(
        None, "speculative decoding, as JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
              "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5} proposes up to 4 tokens a step by finding the "
              "sequence's last n-gram earlier in it, {\"method\": \"draft_model\", \"model\": PATH, "
              "\"num_speculative_tokens\": 4} by running a small model of the same tokenizer; each is verified "
              "exactly (greedy output unchanged, sampling keeps the model's distribution). Optional keys: "
              "disable_by_batch_size (no proposals while more sequences run; default 16), min_acceptance_rate (a "
              "sequence whose drafts are accepted less often pauses proposing; default 0.2) (default: off)",
        type=str)
    # not a setting: what `load` resolves to, filled in once by the engine before its workers start (they read
    # the checkpoint, dtype, context length and quantization from here)
    resolved_model: ResolvedModel | None = None
    # likewise the draft checkpoint of speculative_config's method draft_model (None for any other method)
    resolved_draft_model: ResolvedModel | None = None

    SECTIONS = {"load": LoadConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig,
                "lora": LoRAConfig, "multimodal": MultiModalConfig}

    def __post_init__(self):
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        spec, parallel = self.speculative_config, self.parallel
        if spec is not None and spec.method == "draft_model" and (parallel.tensor_parallel_size > 1
                                                                  or parallel.pipeline_parallel_size > 1):
            # the draft model runs whole beside the sampler, in the one worker that samples
            raise ConfigError(f"speculative_config: method 'draft_model' runs in one worker: tensor_parallel_size "
                              f"({parallel.tensor_parallel_size}) and pipeline_parallel_size "
                              f"({parallel.pipeline_parallel_size}) must be 1")
        if self.lora.enable_lora and self.parallel.data_parallel_size > 1:
            # the router would have to check adapters and keep each adapter's prefixes apart; not built yet
            raise ConfigError(f"enable_lora runs without data parallelism for now: data_parallel_size is "
                              f"{self.parallel.data_parallel_size}, must be 1")

    @classmethod
    def settings(cls) -> list[tuple[str | None, dataclasses.Field]]:
        """(section name or None for a top-level field, field) for every setting (a field declared with
        `setting`, so with a help text)."""
        out = [(name, f) for name, section in cls.SECTIONS.items() for f in dataclasses.fields(section)]
        top = [f for f in dataclasses.fields(cls) if f.name not in cls.SECTIONS and "help" in f.metadata]
        return out + [(None, f) for f in top]

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """Flat settings (LLM(block_size=32, ...), the CLI's parsed flags) into their sections."""
        sections: dict[str, dict] = {name: {} for name in cls.SECTIONS}
        top = {}
        known = {f.name: section for section, f in cls.settings()}
        for key, value in kwargs.items():
            if key not in known:
                raise ConfigError(f"unknown engine argument {key!r}; engine arguments are: {', '.join(sorted(known))}")
            (sections[known[key]] if known[key] else top)[key] = value
        return cls(**{name: section(**sections[name]) for name, section in cls.SECTIONS.items()}, **top)

    @classmethod
    def from_user_settings(cls, **kwargs) -> EngineConfig:
        """The config an entry point builds from what its user gave (LLM(...)'s arguments, the CLI's flags): as
        from_kwargs, and each setting declared with env= that is not given takes its variable's value, if set.
        A rejected config names the variables it read."""
        from_env = env_defaults([f for _, f in cls.settings()], kwargs.keys())
        try:
            return cls.from_kwargs(**kwargs, **{name: found.value for name, found in from_env.items()})
        except ConfigError as e:
            if not from_env:
                raise
            raise ConfigError(f"{e} (from the environment: {', '.join(map(str, from_env.values()))})") from None
