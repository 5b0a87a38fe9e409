"""credpool under a LiteLLM Router: the callback leases a credential for each call, hands
LiteLLM its key, and releases it with the call's outcome and token usage, streamed or not.

Against a service that holds a credential for openai/gpt-4o in pool ``default`` (the README's
Quickstart), after ``pip install './clients/python[litellm]'``::

    CREDPOOL_INTERNAL_KEY=... python clients/python/examples/litellm_router.py

``CREDPOOL_URL`` names another service than http://127.0.0.1:8080; ``OPENAI_BASE_URL`` another
provider endpoint than OpenAI's (scripts/run-examples points it at a mock).
"""

import asyncio
import os
import sys

import litellm
from litellm.router import Router

from credpool import MissingSetting
from credpool.integrations.litellm import CredpoolLeases

QUESTION = [{"role": "user", "content": "Say hello."}]


async def main() -> None:
    # CREDPOOL_URL and CREDPOOL_INTERNAL_KEY from the environment; provider and model from each
    # call (openai, gpt-4o)
    leases = CredpoolLeases(holder="litellm-example")
    litellm.callbacks = [leases]
    router = Router(
        model_list=[
            {
                "model_name": "gpt-4o",
                "litellm_params": {
                    "model": "openai/gpt-4o",
                    "api_base": os.environ.get("OPENAI_BASE_URL"),
                    # never sent: each call gets its leased key
                    "api_key": "leased per call",
                },
            }
        ],
        num_retries=2,  # each retry is a new attempt with a new lease
    )
    answer = await router.acompletion(model="gpt-4o", messages=QUESTION)
    print(f"answered: {answer.choices[0].message.content!r}, {answer.usage.total_tokens} tokens")
    chunks = await router.acompletion(
        model="gpt-4o",
        messages=QUESTION,
        stream=True,
        metadata={"credpool_affinity_key": "conversation-1"},
    )
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in chunks])
    print(f"streamed: {text!r}")
    # wait for the releases under way before the loop ends
    await leases.aclose()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except MissingSetting as e:  # no CREDPOOL_INTERNAL_KEY: say so, and exit 2
        print(e, file=sys.stderr)
        sys.exit(2)
