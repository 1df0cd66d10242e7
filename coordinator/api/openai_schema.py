"""The OpenAI request bodies fleet takes (chat and legacy completions), what each field becomes, and a
clear 400 for every field OpenAI defines that fleet does not implement.

Fields fleet accepts and ignores, harmless no-ops: ``user``, ``metadata``, ``store`` false,
``service_tier``, ``prompt_cache_key``, ``safety_identifier``, ``parallel_tool_calls`` (without tools),
``stream_options`` without ``stream`` (a response not streamed always carries usage),
``stream_options.include_obfuscation``, ``top_logprobs: 0`` without ``logprobs``, ``modalities: ["text"]``,
``tool_choice: "none"``/``"auto"`` without tools, and fields OpenAI does not define (clients add vendor
fields: ``chat_template_kwargs``, ``return_progress``), except the other servers' fields that change the
answer: vLLM's ``guided_json``, ``guided_regex``, ``guided_choice`` and llama.cpp's ``json_schema`` are
honoured (grammar-constrained decoding, as ``response_format``), and their samplers and grammars fleet does
not have (``min_p``, ``typical_p``, ``mirostat``, ``grammar``, ...; ``VENDOR_REFUSED``) are refused by name,
never ignored. Every other OpenAI field that would change the
answer (``functions`` and ``function_call``, deprecated for ``tools``; a ``response_format`` other than text
and JSON, or one with tools; ``logit_bias``, ``n`` > 1,
``echo``, ``suffix``, ``best_of`` > 1, ``audio``, ``prediction``, ``reasoning_effort``, ``verbosity``,
``web_search_options``) is refused with a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..engine.constraint import Constraint
from ..errors import InvalidRequest
from .limits import count_messages
from ..engine.request import SamplingParams
from ..engine.sampling import Penalties
from .tools import Tool, ToolCall, ToolChoice, parse_tool_choice, parse_tools

if TYPE_CHECKING:
    from ..engine.engine import Engine


class FunctionCall(BaseModel):
    """The function of an assistant's earlier tool call: its name and its arguments as JSON text."""

    name: str
    arguments: str = "{}"


class MessageToolCall(BaseModel):
    """One call of an assistant message's ``tool_calls`` (OpenAI's shape)."""

    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(BaseModel):
    """One part of a message's content: text only (no images or audio)."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message; its content a string, text parts or null (empty)."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = ""
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None  # accepted: a participant's name (templates do not show it)

    def text(self) -> str:
        """The content as one string (text parts joined, null as "")."""
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    @model_validator(mode="after")
    def _unicode(self) -> ChatMessage:
        """JSON may carry lone surrogates (``"\\ud800"``, or their UTF-8-like bytes): not characters,
        and the tokenizer cannot take them."""
        try:
            self.text().encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"content is not valid Unicode: a lone surrogate at character {exc.start}") from None
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        return self

    def as_dict(self) -> dict:
        """The message as ``tools.render_messages`` takes it: role, content (a string), and the calls
        (``ToolCall``s) or the id of the call answered."""
        out: dict = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [ToolCall(c.id, c.function.name, c.function.arguments) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage (and fleet's report)."""

    include_usage: bool = False
    include_obfuscation: bool | None = None  # fleet never pads chunks: nothing to obfuscate


class SamplingRequest(BaseModel):
    """Fields the chat and the legacy completion requests share (unknown fields are ignored)."""

    model: str = ""
    max_tokens: int | None = Field(None, ge=1)
    # sampling fields left out take the model's defaults (generation_config.json), else OpenAI's
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, description="fleet extension (as in vLLM): sample among the k best (0 = all)")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0, description="fleet extension (as in vLLM, "
                                             "transformers): > 1 discourages tokens of the prompt and output")
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1, description="only one choice per request")
    ignore_eos: bool = Field(False, description="fleet extension (as in vLLM): do not stop at end-of-sequence")
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted, unused
    # structured output; on the legacy completions a fleet extension, as in vLLM
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's: a JSON schema (or its text)
    guided_regex: str | None = None  # vLLM's
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=1024)  # vLLM's: one of these strings
    json_schema: dict[str, Any] | None = None  # llama.cpp server's
    model_config = {"extra": "allow"}  # other fields are kept to be checked against VENDOR_REFUSED

    def max_tokens_asked(self) -> int | None:
        """The most tokens the request asks for, None when it says nothing."""
        return self.max_tokens

    def logprob_count(self) -> int | None:
        """None: no logprobs; N: each token's logprob and its N best candidates'."""
        return None

    def refuse_unsupported(self) -> None:
        """Raise ``InvalidRequest`` naming the first field set to something fleet does not implement."""
        if self.n not in (None, 1):
            _refuse("n", "fleet generates one choice per request; send n requests instead (n must be 1)")
        if self.logit_bias:
            _refuse("logit_bias", "the last stage returns only its best candidates, so a bias over the whole "
                    "vocabulary cannot be applied")
        for name in VENDOR_REFUSED:
            if (self.model_extra or {}).get(name) not in (None, *VENDOR_REFUSED[name]):
                _refuse(name, "fleet does not implement that sampler or grammar (another server's extension)")
        self.output_constraint()  # a response_format it cannot honour is refused by name

    def output_constraint(self) -> Constraint | None:
        """What the answer must match: ``response_format`` (``response_constraint``), or vLLM's
        ``guided_json``/``guided_regex``/``guided_choice`` or llama.cpp's ``json_schema``; None for free text.
        Raises ``InvalidRequest`` naming the field when it is malformed or more than one is set."""
        asked = {name: value for name, value in (("guided_json", self.guided_json), ("guided_regex", self.guided_regex),
                                                 ("guided_choice", self.guided_choice), ("json_schema", self.json_schema))
                 if value is not None}
        response = self.response_constraint()
        if len(asked) + (response is not None) > 1:
            named = [*(["response_format"] if response is not None else []), *asked]
            _refuse(named[-1], f"{' and '.join(named)} both constrain the answer: send one", plain=True)
        if response is not None or not asked:
            return response
        (name, value), = asked.items()
        if name == "guided_regex":
            return Constraint("regex", value, name)
        if name == "guided_choice":  # a Lark alternation of the strings as JSON-escaped literals
            return Constraint("lark", "start: " + " | ".join(json.dumps(c) for c in value), name)
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                _refuse(name, "guided_json is not a JSON schema (its text does not parse)", plain=True)
        return Constraint.json_schema(value, name)

    def response_constraint(self) -> Constraint | None:
        """What ``response_format`` asks the answer to be (OpenAI's structured outputs): None for ``text``,
        any JSON object for ``json_object``, a value valid under ``json_schema.schema`` for ``json_schema``
        (enforced by grammar-constrained decoding whether or not ``strict`` is set). Raises ``InvalidRequest``
        naming the field for another type or a missing or malformed schema."""
        rf = self.response_format
        if rf is None or rf.get("type") == "text":
            return None
        match rf.get("type"):
            case "json_object":
                return Constraint.json_schema({"type": "object"})
            case "json_schema":
                spec = rf.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                    _refuse("response_format", "json_schema needs an object with a name (and a schema)", plain=True)
                if unknown := sorted(set(spec) - {"name", "description", "schema", "strict"}):
                    _refuse("response_format", f"json_schema.{unknown[0]} is not a field fleet knows (OpenAI's are "
                            f"name, description, schema and strict)", plain=True)
                if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
                    _refuse("response_format", "json_schema.strict must be true or false", plain=True)
                schema = spec.get("schema", {})
                if not isinstance(schema, (dict, bool)):
                    _refuse("response_format", "json_schema.schema must be a JSON schema object", plain=True)
                return Constraint.json_schema(schema)
        _refuse("response_format", f"type {rf.get('type')!r}: fleet takes 'text', 'json_object' and 'json_schema'")
        return None


class ChatCompletionRequest(SamplingRequest):
    """OpenAI's chat completion request, as fleet honours it (see the module docstring for the rest)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # with tool_choice required: whether the answer may hold several calls
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None  # accepted, unused (only stored completions keep it)
    service_tier: str | None = None  # accepted: fleet has one tier
    prompt_cache_key: str | None = None  # accepted: fleet matches prompts by their tokens
    safety_identifier: str | None = None  # accepted, unused

    @field_validator("messages", mode="before")
    @classmethod
    def _bounded(cls, value: object) -> object:
        """At most ``limits.MAX_MESSAGES`` messages and ``MAX_CONTENT_PARTS`` parts, counted before any
        is validated (a million messages took seconds of the event loop to validate)."""
        try:
            count_messages(value)
        except ValueError as exc:
            raise PydanticCustomError("too_many", str(exc)) from None
        return value

    def max_tokens_asked(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's current name), else ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens

    def logprob_count(self) -> int | None:
        """``top_logprobs`` when ``logprobs`` is true (0 without it), None without ``logprobs``."""
        if self.top_logprobs and not self.logprobs:
            _refuse("top_logprobs", "top_logprobs needs logprobs: true", plain=True)
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_request(self) -> tuple[tuple[Tool, ...], ToolChoice]:
        """The tools offered and the ``tool_choice`` (``coordinator.api.tools``). Raises ``InvalidRequest``
        naming ``tools`` or ``tool_choice`` for a tool or a choice fleet cannot take."""
        tools = parse_tools(self.tools)
        return tools, parse_tool_choice(self.tool_choice, tools)

    def refuse_unsupported(self) -> None:
        """Also tools and functions, a response format other than text and JSON, audio, and the fields of features
        fleet does not have (``prediction``, ``reasoning_effort``, ...); ``store: true``."""
        super().refuse_unsupported()
        deprecated = "it is OpenAI's deprecated form of tool calling; send tools (and tool_choice) instead"
        if self.functions:
            _refuse("functions", deprecated)
        if self.function_call not in (None, "none", "auto"):
            _refuse("function_call", deprecated)
        tools, choice = self.tool_request()
        if self.response_format is not None and self.response_format.get("type") != "text" and tools \
                and choice.mode != "none":
            _refuse("response_format", "a JSON response_format with tools: the answer could be neither a call nor "
                    "free to call; send one of them (or tool_choice: none)")
        if self.modalities not in (None, ["text"]) or self.audio is not None:
            _refuse("audio" if self.audio is not None else "modalities", "fleet generates text only")
        for name in ("prediction", "reasoning_effort", "verbosity", "web_search_options"):
            if getattr(self, name) is not None:
                _refuse(name, "fleet does not implement it")
        if self.store:
            _refuse("store", "fleet does not store completions (store must be false)")


class CompletionRequest(SamplingRequest):
    """OpenAI's legacy completion request (``/v1/completions``): a raw prompt, no chat template."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    def logprob_count(self) -> int | None:
        """The legacy ``logprobs``: the count of best candidates per token (0: the token's own only)."""
        return self.logprobs

    def refuse_unsupported(self) -> None:
        """Also ``echo``, ``suffix`` and ``best_of`` > 1."""
        super().refuse_unsupported()
        if self.echo:
            _refuse("echo", "the prompt is not sent back (its logprobs are not computed); echo must be false")
        if self.suffix:
            _refuse("suffix", "fleet does not implement insertion (fill in the middle)")
        if self.best_of not in (None, 1):
            _refuse("best_of", "fleet generates one completion per request (best_of must be 1)")

    def single_prompt(self) -> str | list[int]:
        """The one prompt (a string or token ids): a list of several is refused (one per request)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                _refuse("prompt", f"a list of {len(prompt)} prompts: fleet takes one prompt per request (a string or "
                        "a list of token ids); send one request per prompt", plain=True)
            prompt = prompt[0]
        if not prompt:
            raise InvalidRequest("prompt is empty: give at least one token", param="prompt")
        return prompt


def _refuse(field: str, why: str, plain: bool = False) -> None:
    message = why if plain else f"{field} is not supported by fleet: {why}"
    raise InvalidRequest(message, param=field)


# other servers' request fields fleet does not implement, with the values that change nothing: set to anything
# else, a 400 names them (vLLM's and llama.cpp's samplers and grammars; their constrained outputs are honoured)
VENDOR_REFUSED: dict[str, tuple] = {
    "min_p": (0, 0.0), "typical_p": (1, 1.0), "tfs_z": (1, 1.0), "top_a": (0, 0.0), "mirostat": (0,),
    "mirostat_mode": (0,), "dynatemp_range": (0, 0.0), "xtc_probability": (0, 0.0), "dry_multiplier": (0, 0.0),
    "repeat_last_n": (), "grammar": ("",), "guided_grammar": ("",), "structured_outputs": (), "logits_processors": (),
    "min_tokens": (0,), "bad_words": (), "allowed_token_ids": (), "guided_decoding_backend": (),
}

# what a field is when neither the request nor the model's generation_config.json sets it (OpenAI's defaults)
SAMPLING_FALLBACKS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "frequency_penalty": 0.0,
                      "presence_penalty": 0.0, "repetition_penalty": 1.0}


def resolve_sampling(body: SamplingRequest, engine: Engine, max_tokens_default: int | None = None,
                     ) -> tuple[SamplingParams, dict]:
    """The request's sampling parameters: its own fields, else the model's defaults, else OpenAI's; and
    the report of what was used (the response's ``fleet.sampling``, ``from_model`` naming the defaults taken).

    ``max_tokens_default`` replaces the coordinator's ``max_tokens_default`` for requests silent on it
    (the legacy completions' 16). Raises ``InvalidRequest`` for an unsupported field (``refuse_unsupported``),
    a bad ``stop`` list, or more ``top_logprobs``/``logprobs`` than the ``sample_top_k`` candidates."""
    body.refuse_unsupported()
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > 4 or any(not s for s in stop):
        raise InvalidRequest("stop takes up to 4 non-empty strings", param="stop")
    logprobs = body.logprob_count()
    if logprobs is not None and logprobs > (limit := engine.settings.sample_top_k):
        field = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
        raise InvalidRequest(f"{field} is {logprobs}, more than the {limit} candidates this fleet's last stage "
                             f"returns per token (the coordinator's --sample-top-k); ask for at most {limit}",
                             param=field)
    model = engine.generation_defaults
    used, from_model = {}, []
    for name, fallback in SAMPLING_FALLBACKS.items():
        value = getattr(body, name)
        if value is None and name in model:
            value = model[name]
            from_model.append(name)
        used[name] = fallback if value is None else value
    max_tokens = body.max_tokens_asked()
    if max_tokens is None and "max_tokens" in model:
        max_tokens = max(1, int(model["max_tokens"]))
        from_model.append("max_tokens")
    used["max_tokens"] = max_tokens or max_tokens_default or engine.settings.max_tokens_default
    params = SamplingParams(
        max_tokens=used["max_tokens"], temperature=used["temperature"], top_p=used["top_p"], seed=body.seed,
        stop=tuple(stop), ignore_eos=body.ignore_eos, top_k=used["top_k"], logprobs=logprobs,
        penalties=Penalties(used["frequency_penalty"], used["presence_penalty"], used["repetition_penalty"]),
        constraint=body.output_constraint())
    return params, {**used, "from_model": from_model}
