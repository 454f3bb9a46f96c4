"""The KV hand-over between the prefill and the decode worker: what crosses torch.distributed, in
what order, and how a block's bytes are laid out. No engine state here; the workers call these.

One transfer, prefill (rank 0) -> decode (rank 1), strictly in turn (one transfer at a time, so
point-to-point messages never interleave):

    P -> D  int64[1]  header length;  uint8[len]  the pickled Header
    D -> P  int64[1]  how many leading blocks the decode side already holds (a prefix-cache hit:
                      those are not sent), or -1: drop it (aborted meanwhile, or the decode side
                      is closing); the prefill side then sends nothing more for it
    P -> D  uint8[(n - skip) * block_bytes]  the payload, when skip < n

Payload layout: for each layer, for each tensor of its cache tuple (K, V[, K scales, V scales]), the
rows of the blocks sent, in table order. Both sides derive the layout from their own caches and
check `block_bytes` in the header, so a model or KV dtype mismatch fails loudly instead of decoding
garbage.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from asyncpage.outputs import TokenLogprob
from asyncpage.params import SamplingParams

PREFILL_RANK = 0
DECODE_RANK = 1
DROP = -1


class Transport(Protocol):
    """Blocking point-to-point send/recv of a contiguous CPU tensor to/from the one peer."""

    def send(self, tensor: torch.Tensor) -> None: ...

    def recv(self, tensor: torch.Tensor) -> None: ...


class DistTransport:
    """torch.distributed (gloo) to the peer rank: the process group must be initialized."""

    def __init__(self, peer: int) -> None:
        self.peer = peer

    def send(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.send(tensor, self.peer)

    def recv(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.recv(tensor, self.peer)


@dataclass
class Header:
    rid: int  # the front end's id of the request
    prompt_token_ids: list[int]
    first_token: int  # sampled by the prefill worker from the prompt's last logits
    first_logprob: TokenLogprob | None
    params: SamplingParams  # the caller's, not the prefill worker's max_tokens=1 copy
    num_blocks: int  # blocks covering the prompt: ceil(len(prompt) / block_size)
    block_bytes: int  # payload bytes per block (all layers): a layout check


def block_bytes(caches: list[tuple[torch.Tensor, ...]]) -> int:
    """Bytes of one block row over every cache tensor of every layer."""
    return sum(t[0].numel() * t.element_size() for layer in caches for t in layer)


def send_header(tr: Transport, header: Header) -> None:
    data = torch.frombuffer(bytearray(pickle.dumps(header)), dtype=torch.uint8)
    tr.send(torch.tensor([data.numel()], dtype=torch.int64))
    tr.send(data)


def recv_header(tr: Transport) -> Header:
    size = torch.zeros(1, dtype=torch.int64)
    tr.recv(size)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    tr.recv(data)
    header = pickle.loads(data.numpy().tobytes())
    if not isinstance(header, Header):
        raise ValueError(f"expected a Header, got {type(header).__name__}")
    return header


def send_reply(tr: Transport, skip: int) -> None:
    tr.send(torch.tensor([skip], dtype=torch.int64))


def recv_reply(tr: Transport) -> int:
    skip = torch.zeros(1, dtype=torch.int64)
    tr.recv(skip)
    return int(skip.item())


def pack_blocks(caches: list[tuple[torch.Tensor, ...]], block_ids: list[int]) -> torch.Tensor:
    """The payload for `block_ids`: gathered straight into one byte buffer (one copy)."""
    n = len(block_ids)
    ids = torch.tensor(block_ids, dtype=torch.int64)
    out = torch.empty(n * block_bytes(caches), dtype=torch.uint8)
    off = 0
    for layer in caches:
        for t in layer:
            size = n * t[0].numel() * t.element_size()
            torch.index_select(t, 0, ids, out=_view(out[off : off + size], t, n))
            off += size
    return out


def unpack_blocks(caches: list[tuple[torch.Tensor, ...]], block_ids: list[int], payload: torch.Tensor) -> None:
    """Write a payload into the rows `block_ids` of the local caches (same layout as pack_blocks)."""
    n = len(block_ids)
    ids = torch.tensor(block_ids, dtype=torch.int64)
    off = 0
    for layer in caches:
        for t in layer:
            size = n * t[0].numel() * t.element_size()
            _bytes(t).index_copy_(0, ids, _bytes(_view(payload[off : off + size], t, n)))
            off += size
    if off != payload.numel():
        raise ValueError(f"payload of {payload.numel()} bytes, the layout needs {off}")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # index_copy_ has no float8 kernel on the CPU; the same bytes copied as uint8 are the same values
    # (attention.write_kv does the same).
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _view(buf: torch.Tensor, like: torch.Tensor, n: int) -> torch.Tensor:
    """A byte range seen as `n` rows of `like` (its dtype and row shape)."""
    return buf.view(like.dtype).view(n, *like.shape[1:])


def send_blocks(tr: Transport, caches: list[tuple[torch.Tensor, ...]], block_ids: list[int]) -> int:
    """Send the payload of `block_ids`; returns its size in bytes."""
    if not block_ids:
        return 0
    payload = pack_blocks(caches, block_ids)
    tr.send(payload)
    return int(payload.numel())


def recv_blocks(tr: Transport, caches: list[tuple[torch.Tensor, ...]], block_ids: list[int]) -> int:
    """Receive the payload for `block_ids` and write it into the local pool; returns its size."""
    if not block_ids:
        return 0
    payload = torch.empty(len(block_ids) * block_bytes(caches), dtype=torch.uint8)
    tr.recv(payload)
    unpack_blocks(caches, block_ids, payload)
    return int(payload.numel())


def describe(caches: list[tuple[torch.Tensor, ...]]) -> dict[str, Any]:
    """What the two workers compare at start: they must agree on every cache tensor's row."""
    return {"block_bytes": block_bytes(caches),
            "rows": [[(tuple(t.shape[1:]), str(t.dtype)) for t in layer] for layer in caches]}
