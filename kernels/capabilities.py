"""What each attention backend can do, as data (no torch import): the registry's capability half.

``kernels/backends.py`` registers the kernels themselves and reads their devices from here;
``runtime/topology.py`` asks this module whether a named backend can take part in Ring attention
before any rank (or torch) starts. A backend registered at run time with ``register_backend``
declares its traits here too, so both halves always describe the same set of names.

Ring attention (``kernels/ring.py``) merges the partial results of the K/V chunks by their
log-sum-exp, so it runs on any backend that returns one; that is the only thing it needs. A
model's own structured attention (``nabla``: Kandinsky 6 SR's block-sparse mask) is named here too,
with the model that serves it and why Ring cannot run it; ``auto`` never picks it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackendTraits:
    """The capabilities of one registered attention backend."""

    name: str
    """Registry name (``--attention-backend``)."""
    devices: frozenset[str]
    """Device types it runs on (``"cpu"``, ``"cuda"``)."""
    returns_lse: bool = True
    """It returns the log-sum-exp of each query row with the output."""
    model: str | None = None
    """The one model whose attention this is (its own mask, built from the model's inputs), which
    only that model's pipeline serves; ``None`` for a general kernel."""
    ring_refusal: str | None = None
    """Why Ring attention cannot run it although it returns the log-sum-exp (``None``: nothing)."""

    @property
    def supports_ring(self) -> bool:
        """Ring attention merges chunk results by their log-sum-exp: any backend returning it works
        (unless it says why not)."""
        return self.returns_lse and self.ring_refusal is None


_CPU_CUDA = frozenset({"cpu", "cuda"})
_CUDA = frozenset({"cuda"})

NABLA_RING_REFUSAL = (
    "--attention-backend nabla with --ring-degree above 1 is not supported: NABLA picks each query block's "
    "key blocks from all key blocks at once, and a Ring rank holds only a chunk of the keys; shard NABLA with "
    "--ulysses-degree or --tp-size, or run Ring with a dense --attention-backend"
)
"""Why Ring cannot run ``nabla`` (``kernels/nabla.py``)."""

_TRAITS: dict[str, BackendTraits] = {
    t.name: t
    for t in (
        BackendTraits(name="sdpa_math", devices=_CPU_CUDA),
        BackendTraits(name="chunked_math", devices=_CPU_CUDA),
        BackendTraits(name="sdpa_flash_cpu", devices=frozenset({"cpu"})),
        BackendTraits(name="sdpa_cudnn", devices=_CUDA),
        BackendTraits(name="sdpa_flash", devices=_CUDA),
        BackendTraits(name="sdpa_efficient", devices=_CUDA),
        BackendTraits(name="fa", devices=_CUDA),
        BackendTraits(name="fp8", devices=_CUDA),
        BackendTraits(name="fp8_cudnn", devices=_CUDA),
        BackendTraits(name="nabla", devices=_CPU_CUDA, model="Kandinsky 6 SR", ring_refusal=NABLA_RING_REFUSAL),
    )
}
"""Every registered backend's traits, by name (the built-in kernels of ``kernels/backends.py``)."""

AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "chunked_math"),
    "cpu": ("sdpa_flash_cpu", "chunked_math"),
}
"""What ``"auto"`` (or no name) tries per device type, fastest first."""
SDPA_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math"),
    "cpu": ("sdpa_flash_cpu", "sdpa_math"),
}
"""What the user-facing ``"torch_sdpa"`` alias tries per device type."""
FALLBACK_ORDER: tuple[str, ...] = ("chunked_math",)
"""What a selector tries on a device type missing from its table."""
ALIASES: dict[str, str] = {"flash_attn": "fa"}
"""Other names of registered backends (the reference picker's ids)."""
SELECTORS: tuple[str, ...] = ("auto", "torch_sdpa")
"""Names that pick a registered backend per device instead of naming one."""


def declare(traits: BackendTraits, *, replace: bool = False) -> None:
    """Add a backend's traits (``register_backend`` does this); the same traits again are a no-op."""
    known = _TRAITS.get(traits.name)
    if known is not None and known != traits and not replace:
        raise ValueError(f"attention backend {traits.name!r} is already registered")
    _TRAITS[traits.name] = traits


def traits(name: str) -> BackendTraits:
    """The traits of the registered backend ``name`` (an alias is followed); ``ValueError`` if unknown."""
    found = _TRAITS.get(ALIASES.get(name, name))
    if found is None:
        raise ValueError(unknown_backend_message(name))
    return found


def backend_names() -> list[str]:
    """Every accepted ``--attention-backend`` name: registered backends, the selectors, the aliases."""
    return sorted(_TRAITS) + list(SELECTORS) + sorted(ALIASES)


def model_attention(name: str | None) -> str | None:
    """The model whose own attention ``--attention-backend name`` is (``nabla``: Kandinsky 6 SR),
    ``None`` for a general kernel, a selector or an unknown name."""
    found = None if name is None else _TRAITS.get(ALIASES.get(name, name))
    return None if found is None else found.model


def model_attention_message(name: str) -> str:
    """The one message for a model's own attention asked of another model or of ``attention()``."""
    return (
        f"--attention-backend {name} is {model_attention(name)}'s own block-sparse attention (its mask comes "
        f"from that model's token layout); no other model serves it: choose a dense backend "
        f"({', '.join(n for n in sorted(_TRAITS) if _TRAITS[n].model is None)}) or leave it unset"
    )


def unknown_backend_message(name: str) -> str:
    """The one message for a backend name nobody registered."""
    return f"unknown attention backend {name!r}; valid names: {', '.join(backend_names())}"


def candidates(name: str | None, device_type: str | None = None) -> tuple[str, ...]:
    """The registered backends ``name`` may run as: itself, or a selector's choices.

    ``device_type=None`` gives a selector's choices on every device. ``ValueError`` for an
    unknown name.
    """
    key = "auto" if name is None else ALIASES.get(name, name)
    if key in SELECTORS:
        table = AUTO_ORDER if key == "auto" else SDPA_ORDER
        if device_type is None:
            return tuple(dict.fromkeys(n for order in table.values() for n in order))
        return table.get(device_type, FALLBACK_ORDER)
    return (traits(key).name,)


def ring_problem(name: str | None) -> str | None:
    """Why ``--attention-backend name`` cannot run Ring attention, or None when it can.

    A selector qualifies when every backend it may pick returns the log-sum-exp.
    """
    try:
        names = candidates(name)
    except ValueError as exc:
        return str(exc)
    unable = [n for n in names if not traits(n).supports_ring]
    if not unable:
        return None
    refusals = [traits(n).ring_refusal for n in unable if traits(n).ring_refusal]
    if refusals:
        return refusals[0]
    shown = "auto" if name is None else name
    return (
        f"Ring attention merges partial results by their log-sum-exp, which --attention-backend {shown} "
        f"does not return ({', '.join(unable)}); choose a backend that returns it"
    )
