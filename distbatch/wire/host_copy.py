"""GPU tensors to host memory through a small pinned ring, not `.cpu()`.

`.cpu()` copies a GPU tensor into new pageable memory, which the driver has to pin page by page
as the copy goes. On the H200 machine this project was checked on, 92 MB took 64-72 ms that way
and 9 ms staged through two 16 MiB pinned buffers: the GPU fills one while the CPU copies the
other into ordinary memory (the tensor a put sends). Tensors under `STAGED_MIN_BYTES`, and
any not on a CUDA device, are copied with `.cpu()`.

The ring is pinned memory, a process resource (as torch's own caching host allocator is): one
per device, `2 * CHUNK_BYTES`, made on the first staged copy and kept for the process, used by
one copy at a time (copies to the host share the one PCIe link anyway).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CHUNK_BYTES = 16 << 20
STAGED_MIN_BYTES = 1 << 20


class PinnedRing:
    """Two pinned buffers of one CUDA device, for copies to the host in overlapping chunks."""

    def __init__(self, device: torch.device, chunk_bytes: int = CHUNK_BYTES) -> None:
        import torch

        self.device = device
        self.chunk_bytes = chunk_bytes
        self.lock = threading.Lock()
        self._buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous CPU copy of `tensor` (on this ring's device), in pageable memory."""
        import torch

        source = tensor.detach().contiguous()
        out = torch.empty(source.shape, dtype=source.dtype)
        src = source.reshape(-1).view(torch.uint8)
        dst = out.reshape(-1).view(torch.uint8)
        total, chunk = src.numel(), self.chunk_bytes
        with self.lock, torch.cuda.device(self.device):
            stream = torch.cuda.current_stream()  # after whatever made the tensor
            done = [torch.cuda.Event(), torch.cuda.Event()]
            pending: list[tuple[int, int] | None] = [None, None]
            for k, start in enumerate(range(0, total, chunk)):
                slot = k & 1
                self._drain(slot, done, pending, dst)  # its previous chunk, before refilling it
                size = min(chunk, total - start)
                self._buffers[slot][:size].copy_(src[start : start + size], non_blocking=True)
                done[slot].record(stream)
                pending[slot] = (start, size)
            for slot in (0, 1):
                self._drain(slot, done, pending, dst)
        return out

    def _drain(
        self,
        slot: int,
        done: list[torch.cuda.Event],
        pending: list[tuple[int, int] | None],
        dst: torch.Tensor,
    ) -> None:
        """Copy the chunk waiting in buffer `slot` (if any) into its place in `dst`."""
        waiting = pending[slot]
        if waiting is None:
            return
        done[slot].synchronize()
        start, size = waiting
        dst[start : start + size].copy_(self._buffers[slot][:size])
        pending[slot] = None


class HostCopies:
    """The pinned rings of this process, one per CUDA device, made on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rings: dict[int, PinnedRing] = {}

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` on the CPU: itself if it is there, else one copy (staged when big and on CUDA)."""
        device = tensor.device
        if device.type == "cpu":
            return tensor
        if device.type != "cuda" or tensor.numel() * tensor.element_size() < STAGED_MIN_BYTES:
            return tensor.cpu()
        index = device.index if device.index is not None else 0
        with self._lock:
            ring = self._rings.get(index)
            if ring is None:
                import torch

                ring = self._rings[index] = PinnedRing(torch.device("cuda", index))
        return ring.to_host(tensor)


HOST_COPIES = HostCopies()
"""The process's rings: pinned memory is a process resource, like torch's own host allocator."""
