"""Stream a chat completion (SSE) with usage (run `make serve` first).

python examples/openai_stream.py [BASE_URL]
"""

import sys

from openai import OpenAI

base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8770/v1"
client = OpenAI(base_url=base, api_key="unused-with-auth-none")

stream = client.chat.completions.create(
    model="assistant",
    messages=[{"role": "user", "content": "/slow 12"}],
    stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
        if chunk.choices[0].finish_reason:
            print(f"\n[finish_reason: {chunk.choices[0].finish_reason}]")
    elif chunk.usage:
        print(f"[usage: {chunk.usage.prompt_tokens} in, {chunk.usage.completion_tokens} out]")
