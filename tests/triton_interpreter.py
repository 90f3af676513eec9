"""Triton's interpreter, made cheaper for the tests (tests/conftest.py, and the refactor gate's processes):
the same interpreted ops, the same bits."""

from __future__ import annotations

import inspect
import os
import threading


def patch_once_a_launch() -> None:
    """Triton's interpreter re-patches triton.language (inspect.getmembers over tl, tl.tensor, tl.math, ...) on
    every call of a device function (each tl.sum, tl.zeros, each @triton.jit helper), in every program of every
    launch: about a third of an interpreted kernel test's time. Those repeats change nothing: within one launch a
    module already patched stays patched until the launch's end restores it (a device call's own patches are never
    restored). Here a device call re-patches only the modules this launch has not yet patched; the kernels run the
    same interpreted ops, the same bits. Launches of two threads at once patch on every device call, as the
    interpreter does, and a launch's end (which restores the modules for every thread) makes the others patch
    afresh. Off where Triton's interpreter is not built as read here, and without TRITON_INTERPRET; call it once TRITON_INTERPRET is set (triton.language must not be imported before it)."""
    if os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes", "y"):
        return
    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except ImportError:
        return
    try:
        is_as_read = all(hasattr(ti, name) for name in ("_patch_lang", "_LangPatchScope", "GridExecutor")) and \
            "_patch_lang(self.fn)" in inspect.getsource(ti.InterpretedFunction.__call__) and \
            "_patch_lang(self.fn)" in inspect.getsource(ti.GridExecutor.__call__)
    except (AttributeError, OSError, TypeError):
        is_as_read = False
    if not is_as_read or getattr(ti, "_qse_once_a_launch", False):
        return
    patch_lang, run_launch = ti._patch_lang, ti.GridExecutor.__call__
    state = threading.local()  # state.patched in a launch: the modules (ids) it has patched
    in_flight = {"launches": 0, "ends": 0}  # launches running now; launches ended so far
    lock = threading.Lock()
    langs_of: dict = {}

    def langs(fn) -> frozenset:
        if fn not in langs_of:  # as _patch_lang finds them
            langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                     if inspect.ismodule(v) and v in (tl, tl.core))
        return langs_of[fn]

    def patch_once(fn):
        patched = getattr(state, "patched", None)
        if patched is None or in_flight["launches"] > 1:
            return patch_lang(fn)
        if state.ends != in_flight["ends"]:  # another thread's launch ended (and restored) since: patch afresh
            patched, state.ends = frozenset(), in_flight["ends"]
        if patched and langs(fn) <= patched:
            return ti._LangPatchScope()
        scope = patch_lang(fn)
        state.patched = patched | langs(fn)
        return scope

    def launch(self, *args, **kwargs):
        with lock:
            in_flight["launches"] += 1
            state.ends = in_flight["ends"]
        state.patched = frozenset()
        try:
            return run_launch(self, *args, **kwargs)
        finally:
            state.patched = None
            with lock:
                in_flight["launches"] -= 1
                in_flight["ends"] += 1

    ti._patch_lang = patch_once
    ti.GridExecutor.__call__ = launch
    ti._qse_once_a_launch = True
