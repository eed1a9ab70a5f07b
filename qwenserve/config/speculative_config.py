"""Speculative decoding settings, as vLLM takes them: `--speculative-config '{"method": "ngram",
"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'`, or `{"method": "draft_model",
"model": PATH, "num_speculative_tokens": 4}`, or `LLM(speculative_config={...})`. One validated object; a bad
value is a ConfigError naming its key."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

from qwenserve.config.errors import ConfigError

METHODS = ("ngram", "draft_model")
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's n-gram length when neither bound is given


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # draft tokens proposed (and verified) per sequence and step, at most
    prompt_lookup_min: int | None = None  # ngram: the shortest suffix n-gram that may match (draft_model: None)
    prompt_lookup_max: int | None = None  # ngram: the longest suffix n-gram tried first (draft_model: None)
    model: str | None = None  # draft_model: the draft checkpoint (HF directory or .gguf), same tokenizer as the target
    # No proposals for any sequence while more than this many are running: past some batch size a step's tokens
    # stop being nearly free (decode stops being bound by reading weights), and verifying drafts that are
    # rejected only costs (docs/speculative_decoding.md has the sweep behind 16). None: never.
    disable_by_batch_size: int | None = 16
    # A sequence whose recent drafts are accepted less often than this stops proposing for a while
    # (core/speculation.py); 0: never.
    min_acceptance_rate: float = 0.2

    def __post_init__(self):
        if self.method not in METHODS:
            raise ConfigError(f"speculative_config: method {self.method!r} is not one of {', '.join(METHODS)}")
        _check_int(self, "num_speculative_tokens", 1)
        if self.method == "draft_model":
            self._check_draft_model()
        else:
            self._check_ngram()
        if self.disable_by_batch_size is not None:
            _check_int(self, "disable_by_batch_size", 1)
        rate = self.min_acceptance_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise ConfigError(f"speculative_config: min_acceptance_rate must be in [0, 1], got {rate!r}")

    def _check_draft_model(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"speculative_config: method 'draft_model' needs model (the draft checkpoint: an HF "
                              f"directory or a .gguf file), got {self.model!r}")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(self, name) is not None:
                raise ConfigError(f"speculative_config: {name} is for method 'ngram'; method 'draft_model' takes "
                                  f"none")

    def _check_ngram(self) -> None:
        if self.model is not None:
            raise ConfigError(f"speculative_config: model {self.model!r} is for method 'draft_model'; method "
                              f"{self.method!r} takes none")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        object.__setattr__(self, "prompt_lookup_min", hi if lo is None else lo)
        object.__setattr__(self, "prompt_lookup_max", lo if hi is None else hi)
        _check_int(self, "prompt_lookup_min", 1)
        _check_int(self, "prompt_lookup_max", 1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                              f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a JSON string (the CLI's flag), a dict (LLM's argument) or an instance; None or "" stays None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config is not valid JSON ({e}): {value!r}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config must be a JSON object such as "
                              f'{{"method": "ngram", "num_speculative_tokens": 4}}, got {value!r}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative_config: unknown key {unknown[0]!r}; the keys are: "
                              f"{', '.join(sorted(known))}")
        for name in ("method", "num_speculative_tokens"):
            if name not in value:
                raise ConfigError(f"speculative_config: {name} is required")
        return cls(**value)


def _check_int(config: SpeculativeConfig, name: str, least: int) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"speculative_config: {name} must be an integer >= {least}, got {value!r}")
