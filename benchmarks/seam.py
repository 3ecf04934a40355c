"""Does a continuation of a stream's text go on as the uninterrupted answer would (issue 42's takeover seam)?

Against a running gateway on an embedded model: each prompt's uninterrupted streamed answer at temperature 0, then,
for each cut after its k-th token, the text so far handed back as a partial assistant turn to continue
(`continue_final_message`, its trailing whitespace held back as `ChatCompletionRequest.continued` does) for a few
tokens; the joined text is compared with the uninterrupted one. It checks what the model and the chat template do
with a re-tokenized seam, not a timing: the machine's speed does not matter.

    .venv/bin/python -m benchmarks.seam --base-url http://127.0.0.1:8000 [--ignore-eos]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import httpx

PROMPTS = ("Write the numbers from 340 to 400 separated by commas.",
           "Write a short story about a cat who learns to fly.")


def streamed(client: httpx.Client, base: str, body: dict[str, Any]) -> list[str]:
    """The answer's text, a chunk (a token) an item."""
    texts: list[str] = []
    with client.stream("POST", f"{base}/v1/chat/completions", json=body,
                       headers={"cache-control": "no-cache"}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                text = (choices[0].get("delta") or {}).get("content")
                if text:
                    texts.append(text)
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--cuts", type=int, default=58, help="cut after tokens 2 .. cuts+1")
    parser.add_argument("--ignore-eos", action="store_true", help="run past the model's end of turn")
    args = parser.parse_args()
    with httpx.Client(timeout=300) as client:
        model = client.get(f"{args.base_url}/v1/models").json()["data"][0]["id"]
        base = {"model": model, "temperature": 0, "stream": True, "ignore_eos": args.ignore_eos}
        for prompt in PROMPTS:
            messages = [{"role": "user", "content": prompt}]
            tokens = streamed(client, args.base_url, {**base, "messages": messages, "max_tokens": args.max_tokens})
            whole, bad, cuts = "".join(tokens), 0, range(2, min(len(tokens) - 6, args.cuts + 2))
            for k in cuts:
                text = "".join(tokens[:k])
                partial = text.rstrip()
                held = text[len(partial):]
                turn = [*messages, {"role": "assistant", "content": partial}]
                more = "".join(streamed(client, args.base_url, {
                    **base, "messages": turn, "max_tokens": 6, "continue_final_message": True,
                    "add_generation_prompt": False}))
                joined = text + more.removeprefix(held[: len(more)])
                if not (whole.startswith(joined) or joined.startswith(whole)):
                    bad += 1
                    print(f"  cut {k}: {text[-12:]!r} went on {joined[len(text):len(text) + 12]!r}, "
                          f"uninterrupted {whole[len(text):len(text) + 12]!r}")
            print(f"{prompt!r}: {len(tokens)} tokens, {len(cuts)} cuts, {bad} went on otherwise", flush=True)


if __name__ == "__main__":
    main()
