"""A lease around each call of the Anthropic Python SDK, streamed or not: the lease's key for the
call, the SDK's exception reported as the outcome (``credpool.outcomes``), the answer's token
usage reported at release.

Against a service that holds a credential for anthropic/claude-sonnet-4 in pool ``default``
(the README's Quickstart, with provider ``anthropic``), after
``pip install ./clients/python anthropic``::

    CREDPOOL_INTERNAL_KEY=... python clients/python/examples/anthropic_sdk.py

``CREDPOOL_URL`` names another service than http://127.0.0.1:8080; ``ANTHROPIC_BASE_URL``
another provider endpoint than Anthropic's (scripts/run-examples points it at a mock).
"""

import asyncio
import sys
from typing import List

import anthropic
from anthropic.types import Message, MessageParam

from credpool import AsyncClient, Lease, MissingSetting

QUESTION: List[MessageParam] = [{"role": "user", "content": "Say hello."}]


def for_lease(sdk: anthropic.AsyncAnthropic, lease: Lease) -> anthropic.AsyncAnthropic:
    """The SDK client for one call: an API key, or an OAuth credential's access token."""
    credential = lease.credential
    if "access_token" in credential:
        return sdk.with_options(auth_token=credential["access_token"], max_retries=0)
    return sdk.with_options(api_key=credential["api_key"], max_retries=0)


async def ask(client: AsyncClient, sdk: anthropic.AsyncAnthropic, stream: bool) -> None:
    async with client.lease(
        "anthropic", "claude-sonnet-4", holder="anthropic-example", wait=30.0
    ) as lease:
        call = for_lease(sdk, lease)  # SDK retries off: a retry should lease again
        message: Message
        try:
            if stream:
                async with call.messages.stream(
                    model=lease.provider_model, max_tokens=256, messages=QUESTION
                ) as events:
                    text = "".join([delta async for delta in events.text_stream])
                    message = await events.get_final_message()
            else:
                message = await call.messages.create(
                    model=lease.provider_model, max_tokens=256, messages=QUESTION
                )
                text = "".join(block.text for block in message.content if block.type == "text")
        except anthropic.APIError as e:
            # 429: rate_limited with its Retry-After; 401: auth_expired; billing; else failure
            lease.report_error(e)
            raise
        tokens = message.usage.input_tokens + message.usage.output_tokens
        lease.report("success", usage_tokens=tokens)
    print(f"{'streamed' if stream else 'answered'}: {text!r}, {tokens} tokens")
    print(f"released: {lease.released}")


async def main() -> None:
    sdk = anthropic.AsyncAnthropic(api_key="leased per call")
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
