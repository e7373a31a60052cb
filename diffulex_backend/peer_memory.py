"""The ranks' shared GPU memory for the one-shot all-reduce and all-gather (kernels/peer_collectives.py), and the rule
for when they run.

A tensor-parallel decode step sums a block of rows times the hidden size twice a layer: 256 KB for one LLaDA-8B
request. NCCL's ring takes some 16 µs for that on NVLink, most of it the protocol's latency, 65 times a step; the
one-shot kernel reads the other ranks' partials from their memory in one launch. Larger sums (a prefill's rows)
stay with NCCL, whose bandwidth wins there. The greedy step's exchange of a few numbers a row (an all-gather) goes
the same way: through NCCL, outside the graphs, it held the host for about a millisecond a step.

Each rank allocates its staging buffer and flag array, and passes their CUDA IPC handles to the others through the
engine's store; every rank then holds the addresses of every rank's buffers, which the kernel reads and writes.
It needs every pair of the ranks' GPUs to reach each other's memory (peer access), and every rank to open the
others' buffers; without that every rank keeps NCCL for every collective.
"""
from __future__ import annotations

import datetime
import pickle

import torch
from torch.multiprocessing.reductions import reduce_tensor

from diffulex_kernels.peer_collectives import (
    one_shot_all_gather, one_shot_all_reduce, one_shot_sum_add_rmsnorm, one_shot_sum_partials,
)

# The largest sum the one-shot kernel makes, in bytes: a batch-32 decode step's rows at hidden 4096 in bfloat16.
CAPACITY = 8 << 20
PROGRAMS = 64  # the kernel's grid: enough loads in flight to stream CAPACITY over NVLink
# The kernel sums in float32: floating dtypes that lose nothing by it. It gathers any dtype but bool (whose bit
# width is not a whole byte).
SUMMED = (torch.bfloat16, torch.float16, torch.float32)
HANDLES = "peer_memory/{}/{}"  # rank r's buffers' handles for rank p, in the engine's store
READY = "peer_memory/ready/{}"  # b"1" once rank r has opened every other rank's buffers, b"0" if it could not


def connect_peers(store, rank: int, size: int, device: torch.device,
                  timeout: datetime.timedelta) -> "PeerCollectives | None":
    """This rank's PeerCollectives, or None on every rank alike: where some pair of the GPUs lacks peer access, or
    where some rank could not allocate its buffers or open another's (a container that forbids CUDA IPC), every
    rank keeps NCCL. A rank that fails still answers every other rank's waits, with an empty handle."""
    if not peers_connected(device.index - rank, size):
        return None  # the same answer on every rank: the GPUs are the same ones
    others = [other for other in range(size) if other != rank]
    try:
        peers = PeerCollectives(rank, size, device, timeout)
    except RuntimeError:
        peers = None
    for other in others:
        store.set(HANDLES.format(rank, other), peers.handles() if peers is not None else b"")
    ready = peers is not None
    if ready:
        try:
            peers.open_others({other: store.get(HANDLES.format(other, rank)) for other in others}, device)
        except RuntimeError:
            ready = False
    store.set(READY.format(rank), b"1" if ready else b"0")
    if all(store.get(READY.format(other)) == b"1" for other in range(size)):
        return peers
    if peers is not None:
        peers.close()
    return None


class PeerCollectives:
    """One rank's side: its buffers, the other ranks' (opened from their handles), and the kernels' calls."""

    def __init__(self, rank: int, size: int, device: torch.device, timeout: datetime.timedelta):
        self.rank = rank
        self.timeout_ns = int(timeout.total_seconds() * 1e9)
        self.staging = torch.zeros(2 * CAPACITY, dtype=torch.uint8, device=device)
        self.flags = torch.zeros(PROGRAMS, size, dtype=torch.int64, device=device)
        self.counts = torch.zeros(PROGRAMS, dtype=torch.int64, device=device)
        torch.cuda.synchronize(device)  # the zeros are in place before any rank may raise a flag in them
        self.others: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # opened, held as long as they are used
        self.open = False

    def handles(self) -> bytes:
        """The buffers' CUDA IPC handles, for one other rank: torch counts the processes that hold a shared tensor
        by the handles it gave out."""
        return pickle.dumps((reduce_tensor(self.staging), reduce_tensor(self.flags)))

    def open_others(self, handles: dict[int, bytes], device: torch.device) -> None:
        """Opens every other rank's buffers from its handles (by rank); raises RuntimeError for a rank that had
        none to give."""
        for other, data in handles.items():
            if not data:
                raise RuntimeError(f"tensor-parallel rank {other} could not share its peer-memory buffers")
            self.others[other] = open_handles(data, device)
        every = [self.others.get(other, (self.staging, self.flags)) for other in range(len(handles) + 1)]
        self.staging_offsets = torch.tensor([staging_offset(s, self.staging) for s, _ in every], dtype=torch.int64,
                                            device=device)
        self.flag_ptrs = torch.tensor([f.data_ptr() for _, f in every], dtype=torch.int64, device=device)
        self.open = True

    def fits(self, tensor: torch.Tensor, summed: bool) -> bool:
        """Whether the kernel takes `tensor`, to sum it or else to gather it; the same answer on every rank, which
        holds a tensor of the same shape and dtype."""
        dtype_ok = tensor.dtype in SUMMED if summed else tensor.dtype != torch.bool
        return (self.open and dtype_ok and tensor.is_contiguous()
                and tensor.numel() * tensor.element_size() <= CAPACITY)

    def close(self) -> None:
        """Lets go of the other ranks' buffers once no kernel uses them (the engine is closing, every rank waits for
        its next plan): a process that exits while another still holds its buffers makes torch warn at its exit.
        The collectives go to NCCL after this, and the captured graphs must not replay."""
        self.open = False
        self.others.clear()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` (which fits) over the ranks, in place."""
        return one_shot_all_reduce(tensor, self.staging.view(tensor.dtype), self.staging_offsets, self.flag_ptrs,
                                   self.counts, self.rank, self.timeout_ns)

    def sum_partials(self, partials: torch.Tensor) -> torch.Tensor:
        """partials [S, *shape] (contiguous, partials[0] fits) summed over S and over the ranks, into partials[0]."""
        return one_shot_sum_partials(partials, self.staging.view(partials.dtype), self.staging_offsets,
                                     self.flag_ptrs, self.counts, self.rank, self.timeout_ns)

    def sum_add_rmsnorm(self, partials: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        fp8: bool):
        """partials [S, T, hidden] (contiguous, partials[0] fits) summed over S and over the ranks, added to
        residual and normalized in one launch: (rows, new residual), the rows as (q, scale) with `fp8`."""
        return one_shot_sum_add_rmsnorm(partials, residual, weight, eps, self.staging.view(partials.dtype),
                                        self.staging_offsets, self.flag_ptrs, self.counts, self.rank,
                                        self.timeout_ns, fp8)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """[size, *shape]: every rank's `tensor` (which fits), rank 0's first."""
        return one_shot_all_gather(tensor, self.staging.view(tensor.dtype), self.staging_offsets, self.flag_ptrs,
                                   self.counts, self.rank, self.timeout_ns)


def open_handles(data: bytes, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Another rank's staging buffer and flag array, mapped for kernels on `device`.

    torch would open a handle in the context of the GPU that holds the memory, where this GPU's kernels cannot
    reach it (an illegal address): the handle opens here in this GPU's context instead, with peer access enabled
    as the mapping needs it. The tensors then say `device`, though their memory is on the other GPU: nothing reads
    them but the kernel, through their addresses. The other rank synchronized before it published the handles, so
    there is no event to wait for."""
    def opened(reduced):
        rebuild, args = reduced
        args = list(args)
        args[6], args[14] = device.index, False  # rebuild_cuda_tensor's storage_device and event_sync_required
        return rebuild(*args)

    staging, flags = pickle.loads(data)
    return opened(staging), opened(flags)


def staging_offset(buffer: torch.Tensor, own: torch.Tensor) -> int:
    """Where `buffer` starts from `own`, in this process's addresses, in the 16-byte units the kernel takes."""
    offset = buffer.data_ptr() - own.data_ptr()
    assert offset % 16 == 0, "the allocator aligns every buffer to 16 bytes or more"
    return offset // 16


def peers_connected(first: int, size: int) -> bool:
    """Whether the GPUs cuda:first..first+size-1 reach each other's memory, every pair of them."""
    gpus = range(first, first + size)
    return all(torch.cuda.can_device_access_peer(a, b) for a in gpus for b in gpus if a != b)
