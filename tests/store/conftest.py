"""Shared fixtures of the store tests: the tiny embedded model on CPU, readers over one disk dir."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qse.engine.engine import Engine
from qse.models import resolve
from qse.shadow.reader import ShadowReader
from store_helpers import GRID


@pytest.fixture(scope="session")
def store_cache_dir(tmp_path_factory) -> Path:
    """The cache dir holding the embedded model (child processes load it from here too)."""
    return tmp_path_factory.mktemp("qse-cache")


@pytest.fixture(scope="session")
def engine(store_cache_dir) -> Engine:
    return Engine(resolve("", torch.device("cpu"), torch.float32, store_cache_dir))


@pytest.fixture
def ref(engine) -> ShadowReader:
    """A reader with no cap and no disk, for fresh prefills."""
    return ShadowReader(engine, grid=GRID, pool_bytes=8 << 20)


@pytest.fixture(autouse=True)
def store_tests_on_one_thread(one_thread):
    """Every store test on one thread (the root conftest's fixture): the states compared are all read in
    this process at this setting."""
