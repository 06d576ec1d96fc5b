"""The only package of elastor_ds that calls torch.distributed."""
from .collectives import Comm, LocalComm, TorchComm, agree

__all__ = ["Comm", "LocalComm", "TorchComm", "agree"]
