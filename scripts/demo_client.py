"""Send the demo's three requests with the official `openai` client and print what came back."""

import argparse

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="unused")
    model = client.models.list().data[0].id
    prompt = "def fibonacci(n):\n"
    done = client.completions.create(model=model, prompt=prompt, max_tokens=64, temperature=0)
    print(f"--- completion (greedy), model {model}\n{prompt}{done.choices[0].text}")
    print(f"--- usage: {done.usage.model_dump()}")
    chat = client.chat.completions.create(model=model, max_tokens=48, temperature=0.8, seed=1,
                                          messages=[{"role": "user", "content": "Write a Python class."}])
    print(f"--- chat (temperature 0.8)\n{chat.choices[0].message.content}")
    print("--- streamed completion")
    for chunk in client.completions.create(model=model, prompt="import os\n", max_tokens=48, temperature=0,
                                           stream=True):
        print(chunk.choices[0].text, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
