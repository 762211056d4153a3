"""Suite-wide set-up. Without a GPU, Triton kernels run through Triton's interpreter
on CPU tensors, so CI checks their math; the variable must be set before triton is
imported anywhere."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
