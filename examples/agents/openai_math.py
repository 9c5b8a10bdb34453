"""A math agent written against the OpenAI client, as any agent would be: it asks
the model, and if the reply has no \\boxed{} answer, asks it once more to check
its work and box the answer. It prints the final answer.

The rollout worker runs it once per episode (task `agent`, agent `openai_math`
with REFLOW_AGENTS_DIR=examples/agents): the problem arrives as JSON on stdin,
and OPENAI_BASE_URL / OPENAI_API_KEY point the client at the worker's
endpoint, whose model is the policy being trained.
"""

import json
import sys

from openai import OpenAI

problem = json.load(sys.stdin)
client = OpenAI()
messages = list(problem["messages"])
answer = client.chat.completions.create(model="policy", messages=messages)
text = answer.choices[0].message.content
if "\\boxed" not in text:
    messages += [{"role": "assistant", "content": text},
                 {"role": "user", "content": "Check your work, then give the final answer "
                  "as \\boxed{...}."}]
    answer = client.chat.completions.create(model="policy", messages=messages)
    text = answer.choices[0].message.content
print(text)
