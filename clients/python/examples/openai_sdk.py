"""A lease around each call of the OpenAI Python SDK, streamed or not: the lease's key for the
call, the SDK's exception reported as the outcome (``credpool.outcomes``), the answer's token
usage reported at release.

Against a service that holds a credential for openai/gpt-4o in pool ``default`` (the README's
Quickstart), after ``pip install ./clients/python openai``::

    CREDPOOL_INTERNAL_KEY=... python clients/python/examples/openai_sdk.py

``CREDPOOL_URL`` names another service than http://127.0.0.1:8080; ``OPENAI_BASE_URL`` another
provider endpoint than OpenAI's (scripts/run-examples points it at a mock).
"""

import asyncio
import sys
from typing import List

import openai
from openai.types.chat import ChatCompletionMessageParam

from credpool import AsyncClient, MissingSetting

QUESTION: List[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello."}]


async def ask(client: AsyncClient, sdk: openai.AsyncOpenAI, stream: bool) -> None:
    async with client.lease("openai", "gpt-4o", holder="openai-example", wait=30.0) as lease:
        # the leased key for this call only; SDK retries off: a retry should lease again
        call = sdk.with_options(api_key=lease.credential["api_key"], max_retries=0)
        try:
            if stream:
                text, tokens = "", None
                async with await call.chat.completions.create(
                    model=lease.provider_model,
                    messages=QUESTION,
                    stream=True,
                    stream_options={"include_usage": True},
                ) as chunks:
                    async for chunk in chunks:
                        if chunk.choices:
                            text += chunk.choices[0].delta.content or ""
                        if chunk.usage:
                            tokens = chunk.usage.total_tokens
            else:
                answer = await call.chat.completions.create(
                    model=lease.provider_model, messages=QUESTION
                )
                text = answer.choices[0].message.content or ""
                tokens = answer.usage.total_tokens if answer.usage else None
        except openai.APIError as e:
            # 429: rate_limited with its Retry-After; 401: auth_expired; quota; else failure
            lease.report_error(e)
            raise
        lease.report("success", usage_tokens=tokens)
    # the stream was closed before the block released the lease
    print(f"{'streamed' if stream else 'answered'}: {text!r}, {tokens} tokens")
    print(f"released: {lease.released}")


async def main() -> None:
    # one SDK client (one connection pool); each call gets its key from its lease
    sdk = openai.AsyncOpenAI(api_key="leased per call")
    # the service and the executor key: CREDPOOL_URL and CREDPOOL_INTERNAL_KEY
    async with AsyncClient.from_env() as client:
        await ask(client, sdk, stream=False)
        await ask(client, sdk, stream=True)


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except MissingSetting as e:  # no CREDPOOL_INTERNAL_KEY: say so, and exit 2
        print(e, file=sys.stderr)
        sys.exit(2)
