"""The Ollama API's request bodies (``/api/chat``, ``/api/generate``) as fleet honours them, what their
``options`` become, and a 400 naming every field Ollama defines that fleet does not implement
(https://github.com/ollama/ollama/blob/main/docs/api.md, the Modelfile's parameters for ``options``).

``options`` map onto the sampling fields the OpenAI endpoints take (``openai_schema.resolve_sampling``):
``temperature``, ``top_p``, ``top_k``, ``seed`` (negative: a random one), ``num_predict`` (``max_tokens``;
-1 and -2: until the context is full), ``stop``, ``repeat_penalty`` (fleet's ``repetition_penalty``, over
the whole prompt and answer: ``repeat_last_n`` -1), ``presence_penalty`` and ``frequency_penalty``. An option
left out takes the model's generation_config.json, else OpenAI's default (not Ollama's own defaults: 0.8,
top_k 40, repeat_penalty 1.1), and ``num_predict`` the coordinator's ``--max-tokens-default``.

Accepted, no effect: ``num_ctx`` up to the fleet's context (which the build fixes), ``keep_alive`` (the
workers keep the model loaded; an empty request that asks to unload it is refused), the options of a local
runner's loading and threads (``numa``, ``num_batch``, ``num_gpu``, ``main_gpu``, ``low_vram``, ``f16_kv``,
``use_mmap``, ``use_mlock``, ``num_thread``), ``num_keep`` (fleet never shifts the context), Mirostat's
``mirostat_tau``/``mirostat_eta`` without Mirostat, ``penalize_newline`` (Ollama ignores it too), and
fields Ollama does not define. Refused by name: other samplers when on (``mirostat``, ``tfs_z``,
``typical_p``, ``min_p``), ``repeat_last_n`` other than -1 with a ``repeat_penalty``, an option Ollama does
not define, ``images``, ``think`` (true or a level), an assistant's earlier ``thinking``, generate's
``suffix``, ``template``, ``context``, ``system`` with ``raw``, and the image generation fields.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..engine.constraint import Constraint
from ..errors import InvalidRequest, ModelNotFound
from .limits import count_messages
from .openai_schema import SamplingRequest
from .tools import ToolCall

# option -> SamplingRequest field
SAMPLING_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed",
                    "num_predict": "max_tokens", "stop": "stop", "repeat_penalty": "repetition_penalty",
                    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
# options that do not change the answer (module docstring); num_ctx is checked against the context
NO_EFFECT_OPTIONS = frozenset({"numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "use_mmap",
                               "use_mlock", "num_thread", "num_keep", "mirostat_tau", "mirostat_eta",
                               "penalize_newline", "num_ctx", "repeat_last_n"})
# options fleet takes only at the value that turns them off, and why
OFF_OPTIONS = {"mirostat": (0, "fleet does not implement Mirostat sampling (mirostat must be 0)"),
               "tfs_z": (1.0, "fleet does not implement tail-free sampling (tfs_z must be 1)"),
               "typical_p": (1.0, "fleet does not implement locally typical sampling (typical_p must be 1)"),
               "min_p": (0.0, "fleet does not implement min-p sampling (min_p must be 0)"),
               "vocab_only": (False, "fleet's workers load the whole model (vocab_only must be false)"),
               "embedding_only": (False, "fleet serves no embeddings (embedding_only must be false)"),
               "logits_all": (False, "fleet returns logprobs (logprobs: true), not logits (logits_all must be false)")}
UNTIL_FULL = (-1, -2)  # num_predict: generate until the context is full (Ollama's -1 infinite, -2 fill)


def refuse(field: str, why: str) -> None:
    """Raise ``InvalidRequest`` naming ``field``: fleet does not implement what it asks, and ``why``."""
    raise InvalidRequest(f"{field} is not supported by fleet: {why}", param=field)


class OllamaFunction(BaseModel):
    """The function of an assistant's earlier tool call: its name and arguments (an object; a JSON string
    is taken too)."""

    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)


class OllamaToolCall(BaseModel):
    """One call of an assistant message's ``tool_calls`` (Ollama's shape: the function alone, an id optional)."""

    function: OllamaFunction
    id: str | None = None


class OllamaMessage(BaseModel):
    """One message of ``/api/chat``: ``role``, ``content``, an assistant's ``tool_calls``, a tool result's
    ``tool_name``; ``images`` and ``thinking`` are refused when set (``chat_messages``)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    images: list[Any] | None = None
    thinking: str | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None

    @model_validator(mode="after")
    def _unicode(self) -> OllamaMessage:
        """JSON may carry lone surrogates, which are no characters (the tokenizer cannot take them)."""
        try:
            (self.content or "").encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"content is not valid Unicode: a lone surrogate at character {exc.start}") from None
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        return self


class OllamaRequest(BaseModel):
    """The fields ``/api/chat`` and ``/api/generate`` share. ``stream`` is true unless set false (Ollama's
    default)."""

    model: str = ""
    stream: bool = True
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def refuse_unsupported(self) -> None:
        """Raise ``InvalidRequest`` naming the first field fleet does not implement (module docstring)."""
        if self.think not in (None, False):
            refuse("think", "the model's answer is not split into thinking and content (think must be false)")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")

    def refuse_unload(self) -> None:
        """An empty request with ``keep_alive`` 0 asks Ollama to unload the model: refused by name."""
        if str(self.keep_alive).strip() in ("0", "0.0", "0s", "0m", "0h"):
            refuse("keep_alive", "fleet's workers keep the model loaded as long as they run; it cannot be "
                   "unloaded through the API (stop the workers instead)")


class OllamaChatRequest(OllamaRequest):
    """``POST /api/chat``: the conversation, and the tools the model may call."""

    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[Any] | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _bounded(cls, value: object) -> object:
        """At most ``limits.MAX_MESSAGES`` messages, counted before any is validated."""
        try:
            count_messages(value)
        except ValueError as exc:
            raise PydanticCustomError("too_many", str(exc)) from None
        return value


class OllamaGenerateRequest(OllamaRequest):
    """``POST /api/generate``: one prompt, through the chat template (as a user turn after ``system``) or,
    with ``raw``, as it is."""

    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[Any] | None = None
    width: int | None = None
    height: int | None = None
    steps: int | None = None

    @field_validator("prompt", "system")
    @classmethod
    def _unicode(cls, value: str | None) -> str | None:
        try:
            (value or "").encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"not valid Unicode: a lone surrogate at character {exc.start}") from None
        return value

    def refuse_unsupported(self) -> None:
        """Also images, a fill-in-the-middle ``suffix``, Ollama's Go ``template``, the deprecated ``context``,
        ``system`` with ``raw`` (no template to put it in) and the image generation fields."""
        super().refuse_unsupported()
        if self.images:
            refuse("images", "fleet's models read text only")
        if self.suffix:
            refuse("suffix", "fleet does not implement insertion (fill in the middle)")
        if self.template:
            refuse("template", "fleet renders prompts with the model's own chat template; send raw: true with a "
                   "prompt you formatted instead")
        if self.context:
            refuse("context", "send the conversation to /api/chat instead (context is deprecated)")
        if self.raw and self.system:
            refuse("system", "with raw: true no template is applied, so there is no place for a system prompt; "
                   "put it in the prompt")
        for name in ("width", "height", "steps"):
            if getattr(self, name) is not None:
                refuse(name, "fleet generates text, not images")


class OllamaSampling(SamplingRequest):
    """An Ollama request's sampling, as ``openai_schema.resolve_sampling`` takes it: the ``options``
    mapped onto ``SamplingRequest``'s fields, the ``format`` (``output_format``) and the logprobs asked."""

    output_format: str | dict[str, Any] | None = None
    logprob_n: int | None = None

    def logprob_count(self) -> int | None:
        """None: no logprobs; N: each token's and its N best candidates' (``logprobs``, ``top_logprobs``)."""
        return self.logprob_n

    def output_constraint(self) -> Constraint | None:
        """``format_constraint`` of the request's ``format``."""
        return format_constraint(self.output_format)


def format_constraint(value: str | dict | None) -> Constraint | None:
    """What Ollama's ``format`` asks the answer to be: None for none (or ""), any JSON object for "json",
    a value valid under the schema for a JSON schema (grammar-constrained decoding, ``constraint``).
    Raises ``InvalidRequest`` naming ``format`` for anything else."""
    if value is None or value == "":
        return None
    if value == "json":
        return Constraint.json_schema({"type": "object"}, field="format")
    if isinstance(value, dict):
        return Constraint.json_schema(value, field="format")
    raise InvalidRequest(f'format must be "json" or a JSON schema (an object), not {value!r}', param="format")


def sampling_request(body: OllamaRequest, max_context: int) -> OllamaSampling:
    """``body``'s ``options`` (and ``format``, logprobs) as an ``OllamaSampling``; ``max_context``: the
    fleet's context in tokens (``num_ctx`` may not pass it; ``num_predict`` -1/-2 ask for all of it).
    Raises ``InvalidRequest`` naming ``options.NAME`` for an option refused (module docstring) or a bad value."""
    options = dict(body.options or {})
    fields: dict[str, Any] = {}
    for name, value in options.items():
        where = f"options.{name}"
        if value is None:
            continue
        if name in SAMPLING_OPTIONS:
            fields[SAMPLING_OPTIONS[name]] = value
        elif name in OFF_OPTIONS:
            off, why = OFF_OPTIONS[name]
            if value != off:
                refuse(where, why)
        elif name not in NO_EFFECT_OPTIONS:
            raise InvalidRequest(f"{where}: {name!r} is not an option Ollama defines (the Modelfile's parameters: "
                                 f"temperature, top_p, top_k, seed, num_predict, stop, repeat_penalty, ...)",
                                 param=where)
    check_context(options, max_context)
    if isinstance(fields.get("seed"), int) and fields["seed"] < 0:
        fields["seed"] = None  # Ollama's -1: a random seed
    if fields.get("max_tokens") in UNTIL_FULL:
        fields["max_tokens"] = max_context  # the engine trims it to the room the prompt leaves
    elif isinstance(fields.get("max_tokens"), int) and fields["max_tokens"] < 1:
        raise InvalidRequest("options.num_predict must be at least 1 (or -1: until the context is full)",
                             param="options.num_predict")
    try:
        return OllamaSampling(model=body.model, **fields, output_format=body.format,
                              logprob_n=(body.top_logprobs or 0) if body.logprobs else None)
    except ValidationError as exc:
        first = exc.errors()[0]
        option = {v: k for k, v in SAMPLING_OPTIONS.items()}.get(str(first["loc"][0]), str(first["loc"][0]))
        param = "format" if option == "output_format" else f"options.{option}"
        raise InvalidRequest(f"invalid {param}: {first['msg']}", param=param) from None


def check_context(options: dict, max_context: int) -> None:
    """``num_ctx`` up to ``max_context``, and ``repeat_last_n`` -1 when a ``repeat_penalty`` applies. Raises
    ``InvalidRequest`` naming the option."""
    num_ctx = options.get("num_ctx")
    if num_ctx is not None and (not isinstance(num_ctx, int) or isinstance(num_ctx, bool) or num_ctx < 1):
        raise InvalidRequest(f"options.num_ctx must be a positive integer, not {num_ctx!r}", param="options.num_ctx")
    if num_ctx is not None and num_ctx > max_context:
        raise InvalidRequest(f"options.num_ctx is {num_ctx}, more than the {max_context} tokens of this fleet's "
                             f"context (fixed by its build and the coordinator's --max-context); ask for at most "
                             f"{max_context}", param="options.num_ctx")
    last_n, penalty = options.get("repeat_last_n"), options.get("repeat_penalty")
    if last_n not in (None, -1) and penalty not in (None, 1, 1.0):
        refuse("options.repeat_last_n", "fleet's repeat_penalty covers the whole context, prompt and answer "
               "(repeat_last_n must be -1)")


def check_model_name(name: str, served: str) -> None:
    """Raise ``InvalidRequest`` when ``name`` is empty and ``ModelNotFound`` when it is neither ``served``
    (the fleet's model id) nor ``served:latest`` (Ollama's names carry a tag, ``latest`` by default)."""
    if not name:
        raise InvalidRequest("model is required", param="model")
    if name not in (served, f"{served}:latest"):
        raise ModelNotFound(f"model {name!r} not found: this fleet serves {served!r} (also named "
                            f"{served + ':latest'!r})", param="model")


def arguments_text(arguments: dict | str) -> str:
    """An earlier call's arguments as the JSON text ``tools.ToolCall`` holds."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def chat_messages(messages: Sequence[OllamaMessage]) -> list[dict]:
    """``messages`` as ``tools.render_messages`` and ``PromptPreparer.chat`` take them: role, content, an
    assistant's calls (``ToolCall``s, ids made up where Ollama gives none) and, for a tool result, the call
    it answers (the first unanswered call of the last assistant message with its ``tool_name``, else the
    first unanswered one). Raises ``InvalidRequest`` naming ``messages[i].images`` or ``.thinking``."""
    out: list[dict] = []
    pending: list[ToolCall] = []
    made = 0
    for i, m in enumerate(messages):
        if m.images:
            refuse(f"messages[{i}].images", "fleet's models read text only")
        if m.thinking:
            refuse(f"messages[{i}].thinking", "fleet does not give the model's thinking back to it; send the "
                   "content alone")
        entry: dict = {"role": m.role, "content": m.content or ""}
        if m.tool_calls:
            calls = []
            for call in m.tool_calls:
                calls.append(ToolCall(call.id or f"call_{made}", call.function.name,
                                      arguments_text(call.function.arguments)))
                made += 1
            entry["tool_calls"], pending = calls, list(calls)
        if m.role == "tool":
            answered = next((c for c in pending if m.tool_name in (None, c.name)), None)
            if answered is not None:
                pending.remove(answered)
                entry["tool_call_id"], entry["name"] = answered.id, answered.name
            else:
                entry["tool_call_id"], entry["name"] = f"call_{made}", m.tool_name or ""
                made += 1
        out.append(entry)
    return out
