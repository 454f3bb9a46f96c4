"""How sequences group, as the scheduler counts them: the seats a sequence takes, a beam search's
beams (which step together), a beam group partly admitted. Pure functions of the request."""

from __future__ import annotations

from asyncpage.core.request import SeqStatus, Sequence


def seat_count(seq: Sequence) -> int:
    """Slots of max_num_seqs a sequence takes: every sample (or beam) counts, so a request that will
    fork into n sequences holds n seats from its admission on."""
    req = seq.request
    return req.width if seq.index == 0 and req.width > 1 and not req.forked else 1


def beam_group(seq: Sequence) -> list[Sequence] | None:
    """The beams of seq's beam search when there are several of them (they must step together)."""
    req = seq.request
    return req.seqs if req.beam is not None and len(req.seqs) > 1 else None


def partly_running(seq: Sequence) -> bool:
    """A waiting beam some of whose siblings are running (they wait for it to catch up)."""
    beams = beam_group(seq)
    return beams is not None and any(b.status is SeqStatus.RUNNING for b in beams)


def beams_ready(beams: list[Sequence]) -> bool:
    """Every beam is running with only its last token left: they can be stepped (together)."""
    return all(b.status is SeqStatus.RUNNING and b.num_tokens - b.num_computed_tokens == 1 for b in beams)
