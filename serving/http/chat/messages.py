"""Chat conversations: validating `messages` and the chat-template options, rendering them to token ids.

`chat_prompt` checks a chat body's `messages`, `add_generation_prompt`, `continue_final_message`,
`chat_template_kwargs` and `add_special_tokens` (a 400 naming the field); `render_chat` renders
the result with the checkpoint's chat template on a worker thread (jinja and the tokenizer block).
An assistant message's `tool_calls` and a tool message's `tool_call_id` reach the template, the calls'
arguments as objects (as HF templates expect them; OpenAI sends JSON text), and so do the request's
tools (`tools=` of `apply_chat_template`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fastgen.serving.http.guard import ApiError

# Arguments of `apply_chat_template` that this module sets itself (or that would change what it
# returns): a request's chat_template_kwargs may not override them.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message", "chat_template",
    "return_dict", "return_tensors", "return_assistant_tokens_mask", "padding", "truncation", "max_length",
    "tokenizer_kwargs", "tools", "documents"})


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A validated conversation, rendered with the chat template (on a worker) just before submission."""

    conversation: list[dict[str, Any]]
    """`{role, content[, name, tool_calls, tool_call_id]}` per message, content parts joined into text."""
    add_generation_prompt: bool = True
    """End the rendering with the template's assistant header (a new reply starts)."""
    continue_final_message: bool = False
    """Leave the final message open, so the model continues it (vLLM's `continue_final_message`)."""
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Extra variables for the template (`chat_template_kwargs`, e.g. `enable_thinking`)."""
    add_special_tokens: bool = False
    """Let the tokenizer add its special tokens (BOS) to the rendering, which usually holds them already."""
    tools: list[dict[str, Any]] | None = None
    """The request's tools, for the template (`tools=`); None without."""

    @property
    def response_role(self) -> str:
        """The role of the reply: "assistant", or with no generation prompt the final message's role (vLLM's rule)."""
        return "assistant" if self.add_generation_prompt else self.conversation[-1]["role"]

    def echo_text(self) -> str:
        """What `echo` prefixes to the reply: the final message's content when its role is the reply's."""
        last = self.conversation[-1]
        return last["content"] if last["role"] == self.response_role else ""


def _message_text(i: int, content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"messages[{i}].content[{j}] must be a text part {{\"type\": \"text\", \"text\": ...}}",
                               param="messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")


def _tool_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, each call's JSON arguments as an object for the template."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ApiError(400, f"{where} must be a list of {{id, type, function: {{name, arguments}}}}", param="messages")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(400, f"{where}[{j}] must be {{id, type: \"function\", function: {{name, arguments}}}}",
                           param="messages")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                raise ApiError(400, f"{where}[{j}].function.arguments must be JSON text", param="messages") from None
        entry = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def chat_conversation(messages: Any) -> list[dict[str, Any]]:
    """Validate `messages` into the conversation the chat template renders."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    conversation = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(400, f"messages[{i}] must be an object with role and content", param="messages")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ApiError(400, f"messages[{i}].role must be a non-empty string", param="messages")
        entry = {"role": role, "content": _message_text(i, message.get("content"))}
        if isinstance(message.get("name"), str):
            entry["name"] = message["name"]
        if message.get("tool_calls") is not None:
            entry["tool_calls"] = _tool_calls(i, message["tool_calls"])
        if isinstance(message.get("tool_call_id"), str):
            entry["tool_call_id"] = message["tool_call_id"]
        conversation.append(entry)
    return conversation


def chat_prompt(request: Any, tools: list[dict[str, Any]] | None = None) -> ChatPrompt:
    """The conversation and template options of a validated chat body (`/v1/chat/completions`,
    `/tokenize`): a request model whose flags are already checked (`request_models`); `tools` (checked
    by `tools.tool_plan`) go to the template."""
    if request.messages is None:
        raise ApiError(400, "messages is required", param="messages")
    conversation = chat_conversation(request.messages)
    add_generation_prompt = request.add_generation_prompt is not False
    continue_final = bool(request.continue_final_message)
    if continue_final and add_generation_prompt:
        raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true: set "
                            "add_generation_prompt to false to continue the final message", param="continue_final_message")
    kwargs = request.chat_template_kwargs or {}
    reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ApiError(400, f"chat_template_kwargs may not set {reserved[0]!r} (a top-level field or set by the "
                            "server)", param="chat_template_kwargs")
    return ChatPrompt(conversation, add_generation_prompt, continue_final, dict(kwargs),
                      bool(request.add_special_tokens), tools)


def render_chat_text(tokenizer: Any, chat: ChatPrompt) -> str:
    """The conversation rendered with the checkpoint's chat template (blocking: run it on a worker)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions", param="messages")
    kwargs = dict(chat.template_kwargs)
    if chat.tools is not None:
        kwargs["tools"] = chat.tools
    try:
        return tokenizer.apply_chat_template(chat.conversation, add_generation_prompt=chat.add_generation_prompt,
                                             continue_final_message=chat.continue_final_message, tokenize=False,
                                             **kwargs)
    except Exception as exc:  # jinja2 and transformers raise their own errors (roles that must alternate...)
        raise ApiError(400, f"messages could not be rendered with the chat template: {exc}", param="messages") from None


def render_chat(tokenizer: Any, chat: ChatPrompt, max_chars: int | None) -> list[int]:
    """The conversation's prompt token ids, rendered with the checkpoint's chat template.

    Blocking (jinja and the tokenizer): run it on a worker. A rendering longer than `max_chars`
    cannot fit the context in tokens, so it is refused without being tokenized.
    """
    text = render_chat_text(tokenizer, chat)
    if max_chars is not None and len(text) > max_chars:
        raise ApiError(400, f"messages render to {len(text)} characters: more than this model's context can hold "
                            f"in tokens (at most {max_chars} characters)", param="messages")
    # The template already holds any BOS it wants: by default encoding must not add another.
    return tokenizer.encode(text, add_special_tokens=chat.add_special_tokens)
