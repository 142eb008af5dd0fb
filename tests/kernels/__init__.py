import torch

# Where the Triton kernels' tests put the kernels' inputs: a GPU where there is one (the
# kernels run for real), else the CPU (tests/conftest.py sets Triton's interpreter).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
