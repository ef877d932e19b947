"""Chat with an agent through the OpenAI SDK (run `make serve` first).

    python examples/openai_chat.py [BASE_URL]

The server keeps the conversation: resending the transcript continues it (history-prefix match),
and the X-Conversation-Id response header names it.
"""

import sys

from openai import OpenAI

base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8770/v1"
client = OpenAI(base_url=base, api_key="unused-with-auth-none")

messages = [{"role": "user", "content": "hello from the SDK"}]
raw = client.chat.completions.with_raw_response.create(model="assistant", messages=messages)
reply = raw.parse().choices[0].message
print("conversation:", raw.headers.get("x-conversation-id"))
print("assistant:", reply.content)

messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "/recall"}]
again = client.chat.completions.create(model="assistant", messages=messages)
print("assistant:", again.choices[0].message.content)
