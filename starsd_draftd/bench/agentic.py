"""An agentic-style workload for the suffix section: chat requests whose answers repeat text the
star has seen. Three kinds, run in order as one stream:

* **code edits**: a real function of this package in the prompt, renamed, the whole function
  asked back (an edit copies its prompt), after one worked example;
* **tool calls**: one fixed tool schema and two worked calls, then several requests each answered
  with one JSON call (calls share their schema's structure and names);
* **conversations**: a few turns in which each later turn asks for the previous answer again
  with a small change (answers reappear), the previous answer included as the assistant's turn.

A conversation's later turns carry the answers its earlier turns got on that run; greedy
outputs are the target's own, so every configuration sends the same requests when its outputs
equal the target alone's (the section checks that they do). The worked examples are there because
the demo's 135M target follows instructions poorly: without them it answers a tool request in
prose and cannot copy a whole file, which no agent framework would accept either."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass

TOOLS = [
    {"name": "get_weather", "description": "Current weather in a city.",
     "parameters": {"city": "string", "unit": "celsius or fahrenheit"}},
    {"name": "search_files", "description": "Find files whose text matches a pattern.",
     "parameters": {"pattern": "string", "path": "string", "glob": "string"}},
    {"name": "create_issue", "description": "Open an issue in the tracker.",
     "parameters": {"title": "string", "labels": "list of strings"}},
    {"name": "send_email", "description": "Send an email.",
     "parameters": {"to": "string", "subject": "string", "body": "string"}},
]
TOOL_SYSTEM = ("You call tools. Answer with exactly one JSON object of the form "
               '{"tool": "<name>", "arguments": {...}} and nothing else. The tools:\n'
               + json.dumps(TOOLS, indent=1))
TOOL_EXAMPLES = [
    ("What is the weather in Paris, in celsius?",
     {"tool": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}),
    ("Open an issue titled 'Docs typo' with the label docs.",
     {"tool": "create_issue", "arguments": {"title": "Docs typo", "labels": ["docs"]}}),
]
TOOL_ASKS = [
    "What is the weather in Lisbon, in celsius?",
    "Find the Python files under src that mention 'retry'.",
    "Open an issue titled 'Crash on empty input' with the labels bug and parser.",
    "What is the weather in Oslo, in fahrenheit?",
    "Find the Markdown files under docs that mention 'install'.",
    "Open an issue titled 'Slow start-up' with the label performance.",
    "Email ana@example.com with the subject 'Release' and the body 'The release is out.'",
    "What is the weather in Kyoto, in celsius?",
]
EDIT_SYSTEM = "You are a code editor. Reply with the whole edited code in one code block and nothing else."
# functions of this package (module, name) and the new name asked for each; the first is the worked example
EDITS = [(("starsd_draftd.backends.base", "top_probs"), "best_probs"),
         (("starsd_draftd.backends.base", "position_seed"), "seed_at"),
         (("starsd_draftd.backends.base", "likeliest"), "most_likely"),
         (("starsd_draftd.backends.base", "clip_draft"), "cut_draft"),
         (("starsd_draftd.backends.base", "frontier_width"), "level_width")]
CONVERSATIONS = [
    ["Write a Python function slugify(title) that lowercases a title and joins its words with hyphens.",
     "Show the whole function again, with a docstring.",
     "Show it once more, renamed to make_slug."],
    ["Write a Python function count_words(text) that returns a dict of each word's count.",
     "Show the whole function again, with type hints.",
     "Show it once more, renamed to word_counts."],
]


@dataclass
class Request:
    kind: str  # "edit", "tool" or "turn"
    messages: list[dict]
    max_tokens: int


def _function(where: tuple[str, str]) -> str:
    import importlib

    module, name = where
    return inspect.getsource(getattr(importlib.import_module(module), name))


def _edit_turn(code: str, new: str) -> dict:
    return {"role": "user", "content": f"Rename the function to {new}.\n```python\n{code}```"}


def edit_requests(max_tokens: int, edits: int | None = None) -> list[Request]:
    (where, new), rest = EDITS[0], EDITS[1:]
    example = _function(where)
    renamed = example.replace(f"def {where[1]}(", f"def {new}(", 1)
    shots = [{"role": "system", "content": EDIT_SYSTEM}, _edit_turn(example, new),
             {"role": "assistant", "content": f"```python\n{renamed}```"}]
    return [Request("edit", shots + [_edit_turn(_function(w), n)], max_tokens) for w, n in rest[:edits]]


def tool_requests(max_tokens: int, asks: int | None = None) -> list[Request]:
    shots = [{"role": "system", "content": TOOL_SYSTEM}]
    for ask, call in TOOL_EXAMPLES:
        shots += [{"role": "user", "content": ask}, {"role": "assistant", "content": json.dumps(call)}]
    return [Request("tool", shots + [{"role": "user", "content": ask}], max_tokens) for ask in TOOL_ASKS[:asks]]


def run_workload(chat: Callable[[Request], dict], max_tokens: int, quick: bool = False) -> list[dict]:
    """Every request of the workload, in order, through ``chat`` (a Request -> the chat API's
    response); a conversation's next turn is sent once its previous answer is in. Returns each
    request (kind, messages) with its response."""
    done = []
    for req in edit_requests(4 * max_tokens, 2 if quick else None) + tool_requests(max_tokens, 4 if quick else None):
        done.append({"kind": req.kind, "messages": req.messages, "response": chat(req)})
    for turns in CONVERSATIONS[: 1 if quick else None]:
        messages: list[dict] = []
        for ask in turns:
            messages = messages + [{"role": "user", "content": ask}]
            response = chat(Request("turn", messages, 2 * max_tokens))
            done.append({"kind": "turn", "messages": messages, "response": response})
            messages = messages + [{"role": "assistant", "content": response["choices"][0]["message"]["content"]}]
    return done
