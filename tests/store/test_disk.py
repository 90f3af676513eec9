"""The parked-file format: a real safetensors file, written atomically, checked before use."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from qse.store import disk
from qse.store.disk import FileMiss


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "ids": torch.arange(10, dtype=torch.int32),
        "a": torch.randn(3, 4, generator=g),
        "b": torch.randn(5, 2, generator=g).to(torch.bfloat16),
        "empty": torch.empty(0, 2, 3),
    }


META = {"format": disk.FORMAT, "version": str(disk.VERSION), "session_id": "s \"quoted\" \x00 🙂", "grid": "32"}


def test_roundtrip_is_exact_and_any_safetensors_reader_opens_it(tmp_path: Path):
    path = tmp_path / "x.safetensors"
    size = disk.write_file(path, tensors(), META)
    assert size == path.stat().st_size
    header = disk.read_header(path)
    assert {k: header.meta[k] for k in META} == META
    back = disk.read_tensors(header)
    for name, t in tensors().items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t)
    lib = load_file(str(path))
    assert all(torch.equal(lib[name], t) for name, t in tensors().items())
    with safe_open(str(path), "pt") as f:
        assert f.metadata()["session_id"] == META["session_id"]
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]  # no temporary left


def test_only_some_tensors_can_be_read(tmp_path: Path):
    path = tmp_path / "x.safetensors"
    disk.write_file(path, tensors(), META)
    got = disk.read_tensors(disk.read_header(path), ["ids"])
    assert list(got) == ["ids"] and torch.equal(got["ids"], tensors()["ids"])


def test_every_byte_is_under_the_checksum(tmp_path: Path):
    path = tmp_path / "x.safetensors"
    disk.write_file(path, tensors(), META)
    raw = path.read_bytes()
    header_end = 8 + int.from_bytes(raw[:8], "little")
    reasons = set()
    for at in list(range(header_end, len(raw), 7)) + [len(raw) - 1]:
        flipped = bytearray(raw)
        flipped[at] ^= 0x01
        path.write_bytes(bytes(flipped))
        with pytest.raises(FileMiss) as exc:
            disk.read_tensors(disk.read_header(path))
        reasons.add(exc.value.reason)
    assert reasons == {"checksum"}


@pytest.mark.parametrize("cut", [0, 4, 8, 20, -1, -13])
def test_a_cut_file_is_a_miss(tmp_path: Path, cut: int):
    path = tmp_path / "x.safetensors"
    disk.write_file(path, tensors(), META)
    raw = path.read_bytes()
    path.write_bytes(raw[:cut] if cut >= 0 else raw[:cut])
    with pytest.raises(FileMiss) as exc:
        disk.read_tensors(disk.read_header(path))
    assert exc.value.reason == ("empty" if cut == 0 else "truncated")


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path, monkeypatch):
    path = tmp_path / "x.safetensors"
    disk.write_file(path, tensors(), META)
    before = path.read_bytes()
    calls = []

    def full(fd, data):
        calls.append(data.nbytes)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        os.write(fd, data)

    monkeypatch.setattr(disk, "_write_all", full)
    with pytest.raises(OSError) as exc:
        disk.write_file(path, {k: t + 1 if t.is_floating_point() else t for k, t in tensors().items()}, META)
    assert disk.write_reason(exc.value) == "disk_full"
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]


def test_file_names_are_safe_for_any_session_id():
    for sid in ["a", "../../etc/passwd", "x/y\\z", "\x00", "🙂" * 300, "\ud800"]:
        name = disk.file_name(sid)
        assert name.endswith(".safetensors") and "/" not in name and len(name) < 100
    assert disk.file_name("a") != disk.file_name("b")


def test_reasons_for_write_errors():
    assert disk.write_reason(OSError(errno.ENOSPC, "")) == "disk_full"
    assert disk.write_reason(OSError(errno.EROFS, "")) == "read_only"
    assert disk.write_reason(PermissionError(errno.EACCES, "")) == "read_only"
    assert disk.write_reason(OSError(errno.EIO, "")) == "write_error"
