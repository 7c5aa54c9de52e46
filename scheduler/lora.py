"""LoRA adapters as rank 0 keeps them: which are loaded, which is active, whether it is merged.

The ranks hold no LoRA state of their own that could drift: at submit, ``LoraRegistry.resolve``
writes the adapter a request runs with into its fields (``lora``, ``lora_path``, ``lora_scale``,
``lora_merged``), which are part of the batch key, and each rank's pipeline brings its weights to
that state before the batch runs (``DiffusersBatchPipeline.use_lora``). So ``set_lora``,
``merge_lora_weights`` and ``unmerge_lora_weights`` change only this registry, take effect from
the next request on, and reach every rank of every replica group in the same order as the
requests themselves.

SGLang-Diffusion's semantics: ``set_lora`` loads (with a path) and activates an adapter, merged
into the weights; ``unmerge_lora_weights`` restores the base model for requests that name no
adapter; ``merge_lora_weights`` applies the active one again (optionally at a new strength). A
request's ``lora`` picks an adapter for that request alone (``"none"``: the base model).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
"""What an adapter's nickname may be."""
NO_LORA = "none"
"""A request's ``lora`` value for the base model."""
SERVER_FIELDS = ("lora_path", "lora_merged")
"""Request fields only the registry writes."""


class LoraError(ValueError):
    """A LoRA request that cannot be honoured (the message names the problem)."""


@dataclasses.dataclass
class LoraRegistry:
    """The adapters the server knows and the active one; see the module doc."""

    allowed_dirs: tuple[Path, ...] = ()
    """Where ``set_lora`` may load new files from (``--lora-dir``); files given at start are trusted."""
    adapters: dict[str, str] = dataclasses.field(default_factory=dict)
    """nickname -> resolved path of its ``.safetensors`` file, in load order."""
    active: str | None = None
    strength: float = 1.0
    merged: bool = False

    @classmethod
    def from_settings(cls, lora_paths, lora_dirs) -> "LoraRegistry":
        """``--lora-path [NAME=]PATH`` (each loaded; the first active and merged) and ``--lora-dir``."""
        registry = cls(allowed_dirs=tuple(Path(d).resolve() for d in lora_dirs))
        for spec in lora_paths:
            name, sep, path = str(spec).partition("=")
            if not sep:
                name, path = Path(spec).stem, spec
            registry.add(name, path, trusted=True)
        if registry.adapters:
            registry.active, registry.merged = next(iter(registry.adapters)), True
        return registry

    @property
    def enabled(self) -> bool:
        """LoRA was switched on at start (an adapter or a directory to load them from)."""
        return bool(self.adapters or self.allowed_dirs)

    def add(self, name: str, path: str, *, trusted: bool = False) -> str:
        if not isinstance(name, str) or not NAME.match(name) or name == NO_LORA:
            raise LoraError(
                f"lora_nickname must be 1-64 letters, digits, '.', '_' or '-' (not {NO_LORA!r}), got {name!r}"
            )
        file = Path(path).expanduser()
        if not trusted:
            resolved = file.resolve()
            if not any(resolved.is_relative_to(root) for root in self.allowed_dirs):
                raise LoraError("lora_path is not allowed: load adapters from a --lora-dir directory")
            file = resolved
        if file.suffix != ".safetensors" or not file.is_file():
            raise LoraError(f"lora_path must be an existing .safetensors file, got {str(path)!r}")
        self.adapters[name] = str(file.resolve())
        return name

    def set(self, name: str, path: str | None = None, strength: float | None = None) -> None:
        """SGLang's ``set_lora``: load ``path`` as ``name`` when given, then make it active, merged."""
        self._check_enabled()
        if path is not None:
            self.add(name, path)
        elif name not in self.adapters:
            raise LoraError(
                f"no adapter {name!r} is loaded (loaded: {', '.join(self.adapters) or 'none'}); give lora_path"
            )
        self.active, self.merged = name, True
        self.strength = self._strength(1.0 if strength is None else strength)

    def merge(self, strength: float | None = None) -> None:
        self._check_enabled()
        if self.active is None:
            raise LoraError("no adapter is set: call set_lora first")
        self.merged = True
        if strength is not None:
            self.strength = self._strength(strength)

    def unmerge(self) -> None:
        self._check_enabled()
        if self.active is None or not self.merged:
            raise LoraError("no adapter is merged")
        self.merged = False

    def listing(self) -> dict[str, Any]:
        """SGLang's ``list_loras`` answer."""
        active = []
        if self.active is not None:
            entry = {"nickname": self.active, "path": self.adapters[self.active]}
            active = [{**entry, "merged": self.merged, "strength": self.strength}]
        return {
            "loaded_adapters": [{"nickname": n, "path": p} for n, p in self.adapters.items()],
            "active": {"transformer": active},
        }

    def resolve(self, fields: dict[str, Any]) -> dict[str, Any]:
        """``fields`` with the adapter this request runs with (see the module doc)."""
        for name in SERVER_FIELDS:
            if name in fields:
                raise LoraError(f"{name} is set by the server; choose an adapter with lora (a loaded nickname)")
        name, scale = fields.get("lora"), fields.get("lora_scale")
        if name is None and scale is not None:
            raise LoraError("lora_scale needs lora (the adapter it scales)")
        if name is None:  # the server's choice: the active adapter while it is merged
            if self.active is None or not self.merged:
                return {**fields, "lora": None}
            return {**fields, "lora": self.active, "lora_path": self.adapters[self.active],
                    "lora_scale": self.strength, "lora_merged": True}  # fmt: skip
        if name == NO_LORA:
            if scale is not None:
                raise LoraError(f"lora_scale cannot scale lora={NO_LORA!r}")
            return {**fields, "lora": None}
        self._check_enabled()
        if name not in self.adapters:
            raise LoraError(f"lora {name!r} is not loaded (loaded: {', '.join(self.adapters) or 'none'})")
        scale = self._strength(scale) if scale is not None else 1.0
        merged = self.merged and name == self.active and scale == self.strength
        return {**fields, "lora": name, "lora_path": self.adapters[name], "lora_scale": scale, "lora_merged": merged}

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise LoraError("LoRA is off on this server: start it with --lora-path or --lora-dir")

    @staticmethod
    def _strength(value) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -10.0 <= value <= 10.0:
            raise LoraError(f"strength must be a number in -10..10, got {value!r}")
        return float(value)
