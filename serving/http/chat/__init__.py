"""Chat completions' own concern: the conversation in, the reply's message out.

- `messages`: `messages` and the chat-template options checked, the conversation (tools, the turns'
  `tool_calls` / `tool_call_id`) rendered with the checkpoint's template.
- `tools`: `tools` / `tool_choice` / `parallel_tool_calls` checked into a `ToolPlan`.
- `tool_parsers`: tool calls parsed out of the reply's text (`--tool-call-parser` formats), incrementally.
- `reasoning`: `<think>` split off into `reasoning_content` (`--reasoning-parser` formats).
- `output`: one choice's reply shaped from those parsers, streamed or not (`ChoiceOutput`).

What it may import: its own modules and `fastgen.serving.http.guard` (`ApiError`, the 400s), nothing
else of fastgen. The routes and request parsing in `serving/http/` import it, never the reverse
(`tests/test_layers.py` checks).
"""
