"""The KV hand-over between the prefill and the decode worker: what crosses the transport
(transport.py: an authenticated socket), in what order, and how a block's bytes are laid out. No
engine state here; the workers call these.

One transfer, prefill -> decode, strictly in turn (one transfer at a time, so messages never
interleave):

    P -> D  frame   the Header, msgspec msgpack (at most MAX_HEADER_BYTES; decoded as a Header or refused)
    D -> P  int     how many leading blocks the decode side already holds (a prefix-cache hit:
                    those are not sent), or -1: drop it (aborted meanwhile, invalid, or the decode
                    side is closing); the prefill side then sends nothing more for it
    P -> D  buffer  (n - skip) * block_bytes raw bytes, when skip < n: received straight into a
                    buffer the decode side sized from its own layout (any other length is refused)

Payload layout: for each layer, for each tensor of its cache tuple (K, V[, K scales, V scales]), the
rows of the blocks sent, in table order. Both sides derive the layout from their own caches (the front
end compares the two at start, and the header carries `block_bytes`), so a model or KV dtype mismatch
fails loudly instead of decoding garbage. Nothing here unpickles: a header is typed data or an error.
"""

from __future__ import annotations

from typing import Protocol

import msgspec
import torch

from asyncpage.outputs import TokenLogprob
from asyncpage.params import SamplingParams

DROP = -1
# A header holds a prompt's token ids and the caller's params: 16 MiB is ~3M ids, far past any context.
MAX_HEADER_BYTES = 16 << 20


class Transport(Protocol):
    """What the hand-over needs of a transport (transport.KVTransport; another, e.g. across nodes,
    must give the same guarantees: an authenticated peer, lengths checked before allocating)."""

    def send_frame(self, data: bytes) -> None: ...

    def recv_frame(self, limit: int) -> bytes: ...

    def send_int(self, value: int) -> None: ...

    def recv_int(self) -> int: ...

    def send_buffer(self, tensor: torch.Tensor) -> None: ...

    def recv_buffer(self, into: torch.Tensor) -> None: ...

    def close(self) -> None: ...


class HeaderError(ValueError):
    """A header frame that is not a valid Header: the peer does not speak this protocol."""


class Header(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    rid: int  # the front end's id of the request
    prompt_token_ids: list[int]
    first_token: int  # sampled by the prefill worker from the prompt's last logits
    first_logprob: TokenLogprob | None
    params: SamplingParams  # the caller's, not the prefill worker's max_tokens=1 copy
    num_blocks: int  # blocks covering the prompt: ceil(len(prompt) / block_size)
    block_bytes: int  # payload bytes per block (all layers): a layout check


class Row(msgspec.Struct, frozen=True):
    shape: tuple[int, ...]  # one block's row of a cache tensor
    dtype: str


class Layout(msgspec.Struct, frozen=True):
    """What the two workers compare at start: they must agree on every cache tensor's row."""

    block_bytes: int
    rows: list[list[Row]]


_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(Header)


def block_bytes(caches: list[tuple[torch.Tensor, ...]]) -> int:
    """Bytes of one block row over every cache tensor of every layer."""
    return sum(t[0].numel() * t.element_size() for layer in caches for t in layer)


def send_header(tr: Transport, header: Header) -> None:
    data = _encoder.encode(header)
    if len(data) > MAX_HEADER_BYTES:
        raise HeaderError(f"a header of {len(data)} bytes, past the limit of {MAX_HEADER_BYTES}")
    tr.send_frame(data)


def recv_header(tr: Transport) -> Header:
    """The next header: its length is checked before it is read, its bytes decode as a Header
    (SamplingParams validated as at submission) or HeaderError."""
    return decode_header(tr.recv_frame(MAX_HEADER_BYTES))


def decode_header(data: bytes) -> Header:
    try:
        return _header_decoder.decode(data)
    except (msgspec.DecodeError, ValueError, TypeError) as exc:  # ValueError: SamplingParams' own checks
        raise HeaderError(f"not a KV header: {exc}") from None


def send_reply(tr: Transport, skip: int) -> None:
    tr.send_int(skip)


def recv_reply(tr: Transport) -> int:
    return tr.recv_int()


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
    tr.send_buffer(payload)
    return int(payload.numel())


def recv_blocks(tr: Transport, caches: list[tuple[torch.Tensor, ...]], block_ids: list[int]) -> int:
    """Receive the payload for `block_ids` and write it into the local pool; returns its size."""
    if not block_ids:
        return 0
    payload = torch.empty(len(block_ids) * block_bytes(caches), dtype=torch.uint8)
    tr.recv_buffer(payload)
    unpack_blocks(caches, block_ids, payload)
    return int(payload.numel())


def describe(caches: list[tuple[torch.Tensor, ...]]) -> Layout:
    """This side's layout (the front end checks that both workers' are equal)."""
    return Layout(block_bytes(caches), [[Row(tuple(t.shape[1:]), str(t.dtype)) for t in layer] for layer in caches])
