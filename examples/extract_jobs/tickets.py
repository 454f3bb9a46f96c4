"""The record type of the extraction job example: `--schema tickets:Ticket` (run from this folder).

The descriptions are what the default prompt tells the model about each field."""

from typing import Annotated, Literal

import msgspec


class Ticket(msgspec.Struct):
    customer: Annotated[str, msgspec.Meta(min_length=1, max_length=60,
                                          description="full name of the person who wrote the ticket")]
    product: Annotated[str, msgspec.Meta(min_length=1, max_length=60, description="the product the ticket is about")]
    category: Annotated[Literal["billing", "bug", "outage", "feature_request", "account"],
                        msgspec.Meta(description="what kind of request it is")]
    urgent: Annotated[bool, msgspec.Meta(description="true when the customer says it cannot wait")]
