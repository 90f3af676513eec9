"""The gates run the Triton kernels in the interpreter on the CPU; TRITON_INTERPRET must be set before any
kernel module is imported (Triton reads it when a kernel is decorated)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
