"""Tool calling (function calling), shared by the OpenAI, Anthropic and Ollama APIs: the tools a request
offers and how the model may use them (``spec``), the family's tool-call format and the conversation
rendered for its chat template (``formats``), the calls parsed out of the answer as it streams
(``parser``), and the grammar a forced call is decoded under (``grammar``)."""

from .formats import DEFAULT, SYNTAXES, ToolFormat, detect_format, extra_bytes, render_messages, tools_prompt
from .grammar import tool_constraint, tool_grammar
from .parser import CallDelta, StreamDelta, ToolCallParser, parse_tool_calls
from .spec import (
                   AUTO,
                   NONE,
                   Tool,
                   ToolCall,
                   ToolChoice,
                   check_choice,
                   check_tools_size,
                   check_unique,
                   make_tool,
                   new_call_id,
                   parse_tool_choice,
                   parse_tools,
                   tool_schemas,
)

__all__ = ["AUTO", "DEFAULT", "NONE", "SYNTAXES", "CallDelta", "StreamDelta", "Tool", "ToolCall", "ToolCallParser",
           "ToolChoice", "ToolFormat", "check_choice", "check_tools_size", "check_unique", "detect_format", "extra_bytes", "make_tool",
           "new_call_id", "parse_tool_calls", "parse_tool_choice", "parse_tools", "render_messages",
           "tool_constraint", "tool_grammar", "tool_schemas", "tools_prompt"]
