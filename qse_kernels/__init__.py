"""qse's kernels: Triton kernels and their naive torch twins. Knows tensors only; imports nothing of qse."""
