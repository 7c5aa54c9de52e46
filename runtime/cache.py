"""The local cache where built-in tiny checkpoints are generated (nothing is ever downloaded).

``<cache>/models/<name>`` is generated once and verified on every use:

- **One builder.** ``ensure_model_dir`` takes an exclusive ``fcntl.flock`` on
  ``<cache>/locks/<name>.lock`` before building; every other process (or thread) waits on it,
  then finds the finished directory. Every rank asks for its built-in checkpoint before it joins
  the process group (``rank.start_rank``), so the first one to take the lock builds in-process and
  the others verify; the launcher imports no model code (it starts torchrun at once).
- **Never a weightless copy.** transformers' ``save_pretrained`` writes config and weights only when
  ``is_main_process`` and, if ``torch.distributed`` is initialised in the process, only on
  ``torch.distributed.get_rank() == 0`` (``PreTrainedModel.should_save_on_this_rank``; it reads
  the live process group, not ``RANK``). So a process with an initialised group builds in a
  child interpreter that has no group (and no torchrun variables); others build in-process. A
  build is then checked (every model component has a weight file) before it is accepted.
- **A completion marker written last.** ``<dir>/.tilecast-complete`` is a JSON manifest (every
  file's size and sha256), written into the staging directory after the build and before the
  atomic rename into place.
- **Checked on every use.** A directory without a marker, or whose files disagree with it
  (missing, truncated, changed), is logged as a warning naming it and the fault, moved aside,
  deleted and rebuilt; it is never returned.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

logger = logging.getLogger(__name__)

MARKER = ".tilecast-complete"
"""The manifest file inside a finished checkpoint directory; written last."""
MANIFEST_VERSION = 1
LOCK_TIMEOUT_S = 900.0
"""How long a process waits for another one's build before giving up (``TimeoutError``)."""
BUILD_TIMEOUT_S = 900.0
"""Longest build in a child interpreter."""
WEIGHT_SUFFIXES = (".safetensors", ".bin")
_TORCHRUN_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def default_cache_dir() -> Path:
    """``$TILECAST_CACHE`` if set, else ``~/.cache/tilecast``."""
    env = os.environ.get("TILECAST_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "tilecast"


# ------------------------------------------------------------------------------------ manifest
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MARKER)


def build_manifest(directory: Path) -> dict:
    """``{"version": 1, "files": {relative path: {"size": bytes, "sha256": hex}}}`` of ``directory``."""
    files = {
        path.relative_to(directory).as_posix(): {"size": path.stat().st_size, "sha256": _sha256(path)}
        for path in _files(directory)
    }
    return {"version": MANIFEST_VERSION, "files": files}


def check_structure(directory: Path) -> str | None:
    """What is missing from a freshly built diffusers directory (None: nothing).

    Every component named in ``model_index.json`` must be a non-empty folder, and one holding a
    ``config.json`` (a model, not a tokenizer or scheduler) must hold a weight file: the fault a
    ``save_pretrained`` that skipped this rank leaves behind."""
    index = directory / "model_index.json"
    try:
        components = json.loads(index.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return f"no readable model_index.json ({exc})"
    for name, value in components.items():
        if name.startswith("_") or not isinstance(value, list) or None in value:
            continue
        folder = directory / name
        if not folder.is_dir() or not any(folder.iterdir()):
            return f"component {name}/ is missing or empty"
        if (folder / "config.json").is_file() and not any(p.suffix in WEIGHT_SUFFIXES for p in folder.iterdir()):
            return f"component {name}/ has a config.json but no weights"
    return None


def check_weights_file(directory: Path) -> str | None:
    """What is missing from a freshly built single-file checkpoint (a released transformer file as
    FLUX.2-dev-NVFP4's, no ``model_index.json``): None when it holds a non-empty ``.safetensors``."""
    if not any(p.suffix == ".safetensors" and p.stat().st_size for p in directory.iterdir()):
        return "no .safetensors weight file"
    return None


def check_model_dir(directory: Path) -> str | None:
    """Why ``directory`` is not a complete checkpoint (None: it is; it matches its manifest)."""
    if not directory.is_dir():
        return "missing"
    marker = directory / MARKER
    try:
        manifest = json.loads(marker.read_text())
        files = manifest["files"]
        if manifest.get("version") != MANIFEST_VERSION or not isinstance(files, dict) or not files:
            return f"unreadable completion marker {MARKER} (version {manifest.get('version')!r})"
    except FileNotFoundError:
        return f"incomplete: no completion marker {MARKER}"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable completion marker {MARKER} ({exc})"
    for rel, expected in files.items():
        path = directory / rel
        if not path.is_file():
            return f"{rel} is missing"
        size = path.stat().st_size
        if size != expected.get("size"):
            return f"{rel} has {size} bytes, the manifest says {expected.get('size')} (truncated or changed)"
        if _sha256(path) != expected.get("sha256"):
            return f"{rel} does not match its sha256 in the manifest (corrupt)"
    return None


# ------------------------------------------------------------------------------------ building
def resolve_ref(ref: str) -> Callable:
    """``"package.module:name.attr"`` -> that object (the import path of a writer)."""
    module_name, sep, attr_path = ref.partition(":")
    if not sep or not attr_path:
        raise ValueError(f"writer {ref!r} is not of the form 'module:attribute'")
    target = importlib.import_module(module_name)
    for attr in attr_path.split("."):
        target = getattr(target, attr)
    return target


def _process_group_initialised() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized())


def _write_in_child(writer: str, target: Path) -> None:
    """Run ``writer(target)`` in a fresh interpreter without a process group or torchrun variables."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in _TORCHRUN_ENV and not key.startswith("TORCHELASTIC_")
    }
    command = [sys.executable, "-P", "-m", "tilecast.runtime.cache", writer, str(target)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(
            f"building {target.name} in a child process failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
        )


def write_checkpoint(writer: str, target: Path) -> None:
    """``writer(target)``, where no ``save_pretrained`` can skip this process (see the module doc)."""
    if _process_group_initialised():
        logger.info("torch.distributed is initialised here: building %s in a child process", target.name)
        _write_in_child(writer, target)
    else:
        resolve_ref(writer)(target)


@contextlib.contextmanager
def _exclusive(lock_path: Path, what: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (waits for the holder, at most ``LOCK_TIMEOUT_S``)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as handle:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        waited = False
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError as busy:
                if not waited:
                    logger.info("waiting for another process building %s (lock %s)", what, lock_path)
                    waited = True
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{lock_path} held for over {LOCK_TIMEOUT_S:.0f} s: is a build of {what} hung?"
                    ) from busy
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _discard(path: Path) -> None:
    """Move ``path`` aside (atomic) and delete it."""
    aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.broken-", dir=path.parent))
    os.rename(path, aside / "ckpt")
    shutil.rmtree(aside, ignore_errors=True)


def ensure_model_dir(
    name: str, writer: str, cache_dir: Path | None = None, structure: Callable[[Path], str | None] = check_structure
) -> Path:
    """``<cache>/models/<name>``, verified, generated by ``writer`` when missing or broken.

    ``writer`` is the import path (``"module:attr"``) of a callable that writes a checkpoint into
    the directory it is given (which does not exist yet); an import path, so a child interpreter
    can run it. Safe against concurrent callers, threads or processes (see the module docstring).
    ``structure`` says what a fresh build lacks (default: a diffusers directory's ``check_structure``).
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / "models" / name
    if check_model_dir(target) is None:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(root / "locks" / f"{name}.lock", name):
        problem = check_model_dir(target)
        if problem is None:
            return target  # built by another process while this one waited
        if target.exists():
            logger.warning(
                "the cached checkpoint %s is unusable (%s): removing it and building it again", target, problem
            )
            _discard(target)
        for stale in target.parent.glob(f".{name}.staging-*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a builder that died (we hold the lock)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.staging-", dir=target.parent))
        try:
            built = staging / "ckpt"
            write_checkpoint(writer, built)
            problem = structure(built)
            if problem is not None:
                raise RuntimeError(f"building {name} gave an incomplete checkpoint: {problem}")
            (built / MARKER).write_text(json.dumps(build_manifest(built), indent=1, sort_keys=True) + "\n")
            os.rename(built, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    logger.info("wrote the tiny checkpoint %s", target)
    return target


def _main(argv: list[str]) -> int:
    """``python -m tilecast.runtime.cache WRITER TARGET``: the child side of ``write_checkpoint``."""
    if len(argv) != 2:
        print("usage: python -m tilecast.runtime.cache MODULE:ATTR TARGET_DIR", file=sys.stderr)
        return 2
    resolve_ref(argv[0])(Path(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
