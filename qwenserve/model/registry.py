"""Which model class runs a checkpoint: architecture names -> classes implementing model/interface.py.

A class is registered under the name config.json lists in `architectures` (its HF class name) and, when GGUF
files of it exist, the `general.architecture` llama.cpp writes for it ("qwen2"). The built-in models register
themselves where they are defined (model/models/); another class is one call:

    MODEL_REGISTRY.register("MyModelForCausalLM", MyModelForCausalLM, gguf_architecture="mymodel")

The engine checks a checkpoint's architecture here once, when it resolves the checkpoint (model/loader/
resolve.py); the class then travels to the workers inside the resolved model (pickled by reference: a worker
process imports its module), so a class registered at run time runs in worker processes too."""
from __future__ import annotations

from collections.abc import Sequence

from qwenserve.config.errors import ConfigError
from qwenserve.model.interface import interface_gaps


class ModelRegistry:
    def __init__(self):
        self._classes: dict[str, type] = {}  # architecture -> model class
        self._gguf: dict[str, str] = {}  # GGUF general.architecture -> architecture

    def register(self, architecture: str, model_class: type | None = None, *, gguf_architecture: str | None = None):
        """Register model_class under architecture (and gguf_architecture); without model_class, a decorator
        that registers the class it decorates. Registering a name again with another class is an error."""
        def add(cls: type) -> type:
            gaps = interface_gaps(cls)
            if gaps:
                raise TypeError(f"{cls.__qualname__} cannot be registered as {architecture!r}: it lacks "
                                f"{', '.join(gaps)} of the model interface (qwenserve/model/interface.py)")
            for table, name, value in ((self._classes, architecture, cls), (self._gguf, gguf_architecture,
                                                                           architecture)):
                if name is not None and table.get(name, value) != value:
                    raise ValueError(f"architecture {name!r} is already registered to {table[name]!r}")
            self._classes[architecture] = cls
            if gguf_architecture is not None:
                self._gguf[gguf_architecture] = architecture
            return cls

        return add if model_class is None else add(model_class)

    def resolve(self, architectures: Sequence[str]) -> str:
        """The first of a config.json's architectures that is registered; a ConfigError listing the supported
        ones when none is."""
        _import_builtin_models()
        for name in architectures:
            if name in self._classes:
                return name
        raise ConfigError(f"config field architectures is {list(architectures)}, which qwenserve does not run; "
                          f"supported architectures: {self.supported()}")

    def architecture_for_gguf(self, gguf_architecture: object) -> str:
        """The architecture registered for a GGUF file's general.architecture; a ConfigError listing the
        supported ones when there is none."""
        _import_builtin_models()
        if gguf_architecture not in self._gguf:
            raise ConfigError(f"GGUF general.architecture is {gguf_architecture!r}, which qwenserve does not run; "
                              f"supported: {', '.join(sorted(self._gguf)) or 'none'}")
        return self._gguf[gguf_architecture]

    def model_class(self, architecture: str) -> type:
        _import_builtin_models()
        if architecture not in self._classes:
            raise ConfigError(f"architecture {architecture!r} is not registered; supported architectures: "
                              f"{self.supported()}")
        return self._classes[architecture]

    def supported(self) -> str:
        """'Qwen2ForCausalLM (GGUF qwen2), ...': every registered architecture, for error messages."""
        _import_builtin_models()
        gguf_names = {arch: gguf for gguf, arch in self._gguf.items()}
        return ", ".join(name + (f" (GGUF {gguf_names[name]})" if name in gguf_names else "")
                         for name in sorted(self._classes))


def _import_builtin_models() -> None:
    """The built-in model modules register their classes when imported; importing them here, on first use,
    rather than at the top keeps this module importable from those modules."""
    import qwenserve.model.models  # noqa: F401


MODEL_REGISTRY = ModelRegistry()
