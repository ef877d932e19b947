"""Client tools: the model's call ends the request; the result resumes the same turn.

    python examples/openai_client_tools.py [BASE_URL]

The built-in `echo` model calls a tool when told `/call NAME {json}`.
"""

import json
import sys

from openai import OpenAI

base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8770/v1"
client = OpenAI(base_url=base, api_key="unused-with-auth-none")

tools = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def get_weather(city: str) -> str:
    return f"sunny and 21C in {city}"


messages = [{"role": "user", "content": '/call get_weather {"city":"Paris"}'}]
first = client.chat.completions.create(model="assistant", messages=messages, tools=tools)
choice = first.choices[0]
print("finish_reason:", choice.finish_reason)
messages.append(choice.message.model_dump(exclude_none=True))
for call in choice.message.tool_calls or []:
    args = json.loads(call.function.arguments)
    print(f"model calls {call.function.name}({args})")
    messages.append({"role": "tool", "tool_call_id": call.id, "content": get_weather(**args)})
done = client.chat.completions.create(model="assistant", messages=messages, tools=tools)
print("assistant:", done.choices[0].message.content)

# the same flow on /v1/responses
rtools = [{"type": "function", **tools[0]["function"]}]
r = client.responses.create(model="assistant", input='/call get_weather {"city":"Oslo"}', tools=rtools)
outputs = [
    {"type": "function_call_output", "call_id": o.call_id, "output": get_weather(**json.loads(o.arguments))}
    for o in r.output
    if o.type == "function_call"
]
r2 = client.responses.create(model="assistant", previous_response_id=r.id, input=outputs, tools=rtools)
print("responses:", r2.output_text)
