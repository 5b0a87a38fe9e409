"""One LiteLLM process for the tests: a Router whose one deployment points at the mock upstream,
with :class:`CredpoolLeases` as its callback, sending ``CALLS`` chat completions at once (every
other one streamed), and printing how many were answered as one JSON line.

Environment: ``CREDPOOL_URL``, ``CREDPOOL_INTERNAL_KEY``, ``UPSTREAM`` (the mock's base URL),
``PROVIDER`` (credpool's provider name), ``CALLS``.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any, Dict, List

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm
from litellm.router import Router

from credpool.integrations.litellm import CredpoolLeases


async def call(router: Router, n: int) -> int:
    """One completion; returns the tokens its answer reports."""
    messages: List[Any] = [{"role": "user", "content": f"call {n}"}]
    if n % 2:
        stream = await router.acompletion(
            model="gpt-4o",
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
        )
        tokens = 0
        async for chunk in stream:
            usage = getattr(chunk, "usage", None)
            if usage is not None:
                tokens = int(usage.total_tokens)
        return tokens
    answer: Any = await router.acompletion(model="gpt-4o", messages=messages)
    return int(answer.usage.total_tokens)


async def main() -> Dict[str, Any]:
    leases = CredpoolLeases(provider=os.environ["PROVIDER"], wait=120.0, holder="litellm-worker")
    litellm.callbacks = [leases]
    router = Router(
        model_list=[
            {
                "model_name": "gpt-4o",
                "litellm_params": {
                    "model": "openai/gpt-4o",
                    "api_base": os.environ["UPSTREAM"] + "/v1",
                    # never sent: the callback hands each call its leased key
                    "api_key": "sk-deployment-key-unused",
                },
            }
        ],
        num_retries=0,
    )
    try:
        tokens = await asyncio.gather(*(call(router, n) for n in range(int(os.environ["CALLS"]))))
    finally:
        await leases.aclose()
    return {"answered": len(tokens), "tokens": sum(tokens)}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())), flush=True)
