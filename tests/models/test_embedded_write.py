"""The embedded default checkpoint: written once under a file lock, whole, by one of the processes that start
together; progress bars on a terminal while it is written and while weights load."""

from __future__ import annotations

import io
import threading

import torch

from qse.models.qwen3_5 import load_config, parse_config, presets
from qse.models.qwen3_5.layout import load_weights


def test_two_first_starts_write_one_intact_checkpoint(tmp_path, monkeypatch):
    """Both starters get past the 'already written?' check before either takes the lock (a barrier in front
    of the lock makes that certain); exactly one writes, the other waits and finds the checkpoint whole."""
    arrived = threading.Barrier(2, timeout=60)
    real_lock, real_write = presets.FileLock, presets.write_checkpoint
    writes = []

    class LockAfterBothChecked(real_lock):
        def __enter__(self):
            arrived.wait()
            return super().__enter__()

    def counted_write(*args, **kwargs):
        writes.append(threading.current_thread().name)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(presets, "FileLock", LockAfterBothChecked)
    monkeypatch.setattr(presets, "write_checkpoint", counted_write)
    dirs, errors = {}, []

    def start(name):
        try:
            dirs[name] = presets.ensure_embedded(tmp_path)
        except BaseException as exc:  # reported below, with the thread's name
            errors.append((name, exc))

    threads = [threading.Thread(target=start, args=(n,), name=n) for n in ("first", "second")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(writes) == 1
    assert dirs["first"] == dirs["second"]
    model_dir = dirs["first"]
    # nothing left over beside it but the lock file, and the checkpoint holds the seed's exact tensors
    assert sorted(p.name for p in model_dir.parent.iterdir()) == sorted([model_dir.name, f"{model_dir.name}.lock"])
    cfg = load_config(model_dir)
    loaded = load_weights(model_dir, cfg, "cpu", torch.float32)
    expected = presets.random_tensors(parse_config(presets.embedded_config_dict()), presets.EMBEDDED_SEED)
    got = {**loaded.tensors, **{name: lin.weight for name, lin in loaded.linears.items()}}
    assert set(got) == set(expected)
    assert all(torch.equal(got[name], t) for name, t in expected.items())


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bars_on_a_terminal_only(tmp_path, monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    model_dir = presets.ensure_embedded(tmp_path)
    load_weights(model_dir, load_config(model_dir), "cpu", torch.float32)
    shown = terminal.getvalue()
    assert f"qse: writing {model_dir.name}" in shown and f"qse: loading {model_dir.name}" in shown
    piped = io.StringIO()  # not a terminal: a log file or a pipe gets no bar
    monkeypatch.setattr("sys.stderr", piped)
    load_weights(model_dir, load_config(model_dir), "cpu", torch.float32)
    assert piped.getvalue() == ""
