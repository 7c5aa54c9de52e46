"""Server-side input paths: opened once under the allowed roots, read through that descriptor, and
refused without telling a client anything about the server's files outside the roots."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tilecast.runtime.allowed_files import open_allowed


@pytest.fixture
def roots(tmp_path: Path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "a.mp4").write_bytes(b"the allowed file")
    (outside / "secret.mp4").write_bytes(b"a file the client must never get")
    return allowed, outside


def test_a_file_under_the_root_is_read_as_it_was_when_opened(roots):
    allowed, outside = roots
    link = allowed / "clip.mp4"
    os.symlink(allowed / "a.mp4", link)  # a symlink inside the root is fine
    pinned = open_allowed(str(link), [str(allowed)], field="video_path")
    try:
        assert pinned.name == "clip.mp4" and pinned.size == len(b"the allowed file")
        # Swap the link for one that leaves the root, and replace the target too: the job still
        # reads the file that was checked.
        link.unlink()
        os.symlink(outside / "secret.mp4", link)
        (allowed / "a.mp4").rename(allowed / "moved.mp4")
        assert pinned.read_all() == b"the allowed file"
        assert Path(pinned.path).read_bytes() == b"the allowed file"
    finally:
        pinned.close()
    assert pinned.fd == -1


def _refusal(given: str, roots: list[str]) -> str:
    with pytest.raises(ValueError) as err:
        open_allowed(given, roots, field="video_path")
    return str(err.value)


def test_outside_the_roots_is_only_not_allowed(roots, tmp_path):
    allowed, outside = roots
    os.symlink(outside / "secret.mp4", allowed / "escape.mp4")
    os.symlink(outside / "missing.mp4", allowed / "dangling.mp4")
    os.symlink(outside, allowed / "dirlink")
    cases = [
        str(outside / "secret.mp4"),  # exists, outside
        str(outside / "no-such-file.mp4"),  # does not exist, outside: same answer as one that exists
        str(allowed / "escape.mp4"),  # a symlink out of the root
        str(allowed / "dangling.mp4"),
        str(allowed / "dirlink" / "secret.mp4"),  # a directory symlink out of the root
        str(allowed / ".." / "outside" / "secret.mp4"),
        "/proc/self/environ",  # would resolve to /proc/<rank 0's pid>/environ
        "/etc/passwd",
        "relative/path.mp4",
    ]
    messages = {given: _refusal(given, [str(allowed)]) for given in cases}
    for given, message in messages.items():
        assert "is not allowed" in message, (given, message)
        assert repr(given) in message  # echoed as the client wrote it
        assert str(outside.resolve()) not in message.replace(given, "")  # no resolved target
        assert str(os.getpid()) not in message.replace(given, "")  # no pid
        assert "exist" not in message  # no hint whether the path exists
    # Existing and missing files outside the roots get the very same words.
    assert messages[str(outside / "secret.mp4")].replace("secret.mp4", "X") == messages[
        str(outside / "no-such-file.mp4")
    ].replace("no-such-file.mp4", "X")


def test_inside_the_roots_the_client_hears_what_is_wrong(roots):
    allowed, _ = roots
    assert "does not exist" in _refusal(str(allowed / "missing.mp4"), [str(allowed)])
    (allowed / "folder").mkdir()
    assert "not a regular file" in _refusal(str(allowed / "folder"), [str(allowed)])
    os.mkfifo(allowed / "pipe.mp4")
    assert "not a regular file" in _refusal(str(allowed / "pipe.mp4"), [str(allowed)])  # and does not block


def test_no_roots_disables_server_paths(roots):
    allowed, _ = roots
    message = _refusal(str(allowed / "a.mp4"), [])
    assert "disabled" in message and "--allowed-video-dir" in message


def test_a_sibling_directory_sharing_the_prefix_is_outside(tmp_path):
    (tmp_path / "videos").mkdir()
    (tmp_path / "videos-private").mkdir()
    (tmp_path / "videos-private" / "x.mp4").write_bytes(b"x")
    assert "is not allowed" in _refusal(str(tmp_path / "videos-private" / "x.mp4"), [str(tmp_path / "videos")])
