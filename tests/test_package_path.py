"""``import tilecast`` takes a checkout's root off ``sys.path`` and leaves an install's folder on it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import tilecast

INIT = Path(tilecast.__file__)


def _import_in(folder: Path, code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(folder))
    return subprocess.run(
        [sys.executable, "-P", "-c", code], cwd=folder.parent, env=env, capture_output=True, text=True, timeout=60
    )


def _package(folder: Path) -> None:
    (folder / "tilecast").mkdir(parents=True)
    shutil.copy(INIT, folder / "tilecast" / "__init__.py")


def test_an_installed_tilecast_keeps_its_site_folder_on_the_path(tmp_path):
    # `pip install --target /tmp/site` (or site-packages): tilecast's neighbours must stay importable.
    site = tmp_path / "site"
    _package(site)
    (site / "neighbour").mkdir()
    (site / "neighbour" / "__init__.py").write_text("VALUE = 7\n")
    done = _import_in(site, "import tilecast, neighbour; print(neighbour.VALUE)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "7"


def test_a_checkouts_root_leaves_the_path_so_kernels_is_not_our_folder(tmp_path):
    root = tmp_path / "checkout"
    _package(root)
    (root / "pyproject.toml").write_text("[project]\nname = 'tilecast'\n")
    (root / "kernels").mkdir()
    done = _import_in(root, f"import sys, tilecast; print({str(root)!r} in sys.path)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
