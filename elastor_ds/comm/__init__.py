"""The only package of elastor_ds that calls torch.distributed (with integrations/, testing/ and the
elastic controller): object collectives (:mod:`.collectives`, over :mod:`.objects` and the codec
:mod:`.wire`: nothing received is unpickled), group creation (:mod:`.groups`),
the runtime's tensor collectives (:mod:`.tensors`) and point-to-point transports (:mod:`.transport`).
It imports nothing of checkpoint/ or runtime/ (tests/unit/test_layering.py)."""
from .collectives import Comm, LocalComm, TorchComm, agree
from .transport import GlooTransport, Transport, Work

__all__ = ["Comm", "GlooTransport", "LocalComm", "TorchComm", "Transport", "Work", "agree"]
