"""The record type of the extraction job example: `--schema tickets:Ticket` (run from this folder)."""

from typing import Annotated, Literal

import msgspec

NonEmpty = Annotated[str, msgspec.Meta(min_length=1, max_length=60)]


class Ticket(msgspec.Struct):
    customer: NonEmpty
    product: NonEmpty
    category: Literal["billing", "bug", "outage", "feature_request", "account"]
    urgent: bool
