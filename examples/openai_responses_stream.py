"""Stream a Responses API call with the SDK's `responses.stream()` helper, then continue it.

python examples/openai_responses_stream.py [BASE_URL]
"""

import sys

from openai import OpenAI

base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8770/v1"
client = OpenAI(base_url=base, api_key="unused-with-auth-none")

with client.responses.stream(model="assistant", input="/slow 8", instructions="answer briefly") as stream:
    for event in stream:
        if event.type == "response.output_text.delta":
            print(event.delta, end="", flush=True)
    final = stream.get_final_response()
print(f"\n[{final.id}: {final.status}]")

follow = client.responses.create(model="assistant", input="/recall", previous_response_id=final.id)
print("recall:", follow.output_text)
print("stored:", client.responses.retrieve(final.id).output_text)
