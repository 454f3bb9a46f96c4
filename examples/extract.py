"""Typed extraction over a few documents with the default model: each document becomes a msgspec
Struct, constrained by its JSON Schema while it is generated (no retries, no parsing surprises)."""

import asyncio

import msgspec

from asyncpage import AsyncEngine, ExtractionError


class Contact(msgspec.Struct):
    name: str
    company: str
    email: str


DOCUMENTS = [
    "Hi, I'm Maria Lopez from Acme Robotics. Reach me at maria.lopez@acme-robotics.com.",
    "Best regards,\nTom Becker\nHead of Sales, Nordwind GmbH\ntom.becker@nordwind.de",
    "Contact: Priya Raman (Lumen Analytics) - priya@lumen.ai",
]


async def main() -> None:
    engine = AsyncEngine.from_pretrained()
    async with engine:
        prompts = [f"{doc}\n\nThe contact above as JSON with name, company and email: " for doc in DOCUMENTS]
        results = await asyncio.gather(*(engine.extract(p, Contact) for p in prompts), return_exceptions=True)
    for doc, result in zip(DOCUMENTS, results, strict=True):
        first_line = doc.splitlines()[0][:50]
        if isinstance(result, ExtractionError):
            print(f"{first_line!r}: failed ({result.reason})")
        else:
            print(f"{first_line!r}: {result}")


if __name__ == "__main__":
    asyncio.run(main())
