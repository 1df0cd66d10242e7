"""Chat templates: vendors' templates through fleet's ChatTokenizer equal transformers' ``apply_chat_template`` on
token ids, and fleet's built-in templates (compiler/chat_templates.py) write what llama.cpp's built-ins write.

The vendors' templates are llama.cpp's copies (``models/templates/*.jinja`` of ggml-org/llama.cpp, as vendored by
the llama-cpp-python 0.3.36 sdist on PyPI; fetched by the ``vendor`` fixture, never kept in the repository, as
llama.cpp itself is not): Qwen3-0.6B (thinking on and
off, tools), Qwen2.5-7B-Instruct, Llama 3.1 and 3.2 (tools), Mistral-Nemo-Instruct-2407 (tools), Phi-3.5-mini and
Gemma 2 (gemma turns; that sdist has no Gemma 3 template). Each conversation is rendered by both and tokenized
by one tokenizer holding every family's special tokens (a byte-level BPE trained here), so that a difference in
the rendered text, in a special token or around one, shows in the ids.

The built-ins' expected prompts are llama.cpp's own, for its test conversation (``tests/test-chat-template.cpp``,
``main_automated_tests``: the ``expected_output`` of the chatml, Llama-3, gemma-7b-it, Phi-3-mini, phi-4,
Mistral-Large 'v3' and 'v7' cases, which are what ``llm_chat_apply_template`` writes for those formats).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers.models import BPE

from compiler.chat_templates import MARKERS, TEMPLATES, builtin_template
from coordinator.errors import InvalidRequest
from coordinator.tokenizer import ChatTokenizer

from .test_gguf_tokenizer import CORPUS



@pytest.fixture(scope="module")
def vendor() -> Path:
    """A folder of llama.cpp's copies of the vendors' templates (``models/templates/*.jinja``), taken from the
    llama.cpp tree vendored in the llama-cpp-python sdist (PyPI: ``harness.LLAMA_CPP_PYTHON``): the tree
    ``bench/build_llama_cpp.sh`` unpacked when it is there, else the templates alone extracted from a
    ``pip download`` of the sdist into the tests' model folder (76 MB once; kept between runs)."""
    from bench.harness import LLAMA_CPP_BIN, LLAMA_CPP_PYTHON, TEST_MODELS

    unpacked = LLAMA_CPP_BIN.parents[1] / f"src-{LLAMA_CPP_PYTHON}" / "models" / "templates"
    if all((unpacked / f"{name}.jinja").is_file() for name in FAMILIES):
        return unpacked
    out = TEST_MODELS / f"llama.cpp-templates-{LLAMA_CPP_PYTHON}"
    if all((out / f"{name}.jinja").is_file() for name in FAMILIES):
        return out
    import subprocess
    import sys
    import tarfile
    import tempfile

    from tests.parallel import host_network

    with tempfile.TemporaryDirectory(dir=TEST_MODELS) as tmp, host_network():  # pip downloads from PyPI
        subprocess.run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", "--no-binary",
                        ":all:", "--no-deps", "-d", tmp, f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], check=True,
                       timeout=600)
        part = Path(tmp) / "part"
        part.mkdir()
        with tarfile.open(Path(tmp) / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz") as sdist:
            for member in sdist.getmembers():
                path = Path(member.name)
                if member.isfile() and path.parent.parts[-4:] == ("vendor", "llama.cpp", "models", "templates") \
                        and path.suffix == ".jinja":
                    (part / path.name).write_bytes(sdist.extractfile(member).read())
        part.rename(out)  # whole or not at all
    return out

SPECIALS = sorted({m for _, markers in MARKERS for m in markers} | {
    "<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>", "<|python_tag|>", "<|endoftext|>", "<think>",
    "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<bos>", "<eos>", "<s>",
    "</s>", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
    "<|system|>"})
# template file -> (bos_token, eos_token)
FAMILIES = {
    "Qwen-Qwen3-0.6B": ("<|endoftext|>", "<|im_end|>"),
    "Qwen-Qwen2.5-7B-Instruct": ("<|endoftext|>", "<|im_end|>"),
    "meta-llama-Llama-3.1-8B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "meta-llama-Llama-3.2-3B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "mistralai-Mistral-Nemo-Instruct-2407": ("<s>", "</s>"),
    "microsoft-Phi-3.5-mini-instruct": ("<s>", "<|endoftext|>"),
    "google-gemma-2-2b-it": ("<bos>", "<eos>"),
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Its name."},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}]
CALL = {"id": "call12345", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": {"city": "Paris", "unit": "c"}}}
SYSTEM = {"role": "system", "content": "You are terse. Answer in French when asked to."}
TURNS = [{"role": "user", "content": "Hi! Who are you?"}, {"role": "assistant", "content": "  An assistant.  "},
         {"role": "user", "content": "Say 'déjà vu' 🙂\nthen stop."}]
TOOL_TURNS = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": "", "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": '{"temp": 21}'}]
THINKING = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
            {"role": "user", "content": "And 3+3?"}]
# (template, conversation, template variables)
CASES = [(name, conv, {}) for name in FAMILIES for conv in ("plain", "system")] + [
    ("Qwen-Qwen3-0.6B", "tools", {}), ("Qwen-Qwen3-0.6B", "thinking", {"enable_thinking": True}),
    ("Qwen-Qwen3-0.6B", "thinking", {"enable_thinking": False}), ("Qwen-Qwen3-0.6B", "plain", {"enable_thinking": False}),
    ("Qwen-Qwen2.5-7B-Instruct", "tools", {}), ("meta-llama-Llama-3.1-8B-Instruct", "tools", {}),
    ("meta-llama-Llama-3.2-3B-Instruct", "tools", {}), ("mistralai-Mistral-Nemo-Instruct-2407", "tools", {}),
]
# llama.cpp's test conversation and its built-ins' prompts for it (module docstring)
LLAMA_CPP_CHAT = [{"role": "system", "content": "You are a helpful assistant"}, {"role": "user", "content": "Hello"},
                  {"role": "assistant", "content": "Hi there"}, {"role": "user", "content": "Who are you"},
                  {"role": "assistant", "content": "   I am an assistant   "},
                  {"role": "user", "content": "Another question"}]
LLAMA_CPP_OUTPUT = {
    "chatml": "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
              "<|im_start|>assistant\nHi there<|im_end|>\n<|im_start|>user\nWho are you<|im_end|>\n"
              "<|im_start|>assistant\n   I am an assistant   <|im_end|>\n<|im_start|>user\nAnother question<|im_end|>\n"
              "<|im_start|>assistant\n",
    "llama3": "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant<|eot_id|><|start_header_id|>"
              "user<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHi there"
              "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWho are you<|eot_id|><|start_header_id|>"
              "assistant<|end_header_id|>\n\nI am an assistant<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
              "Another question<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "gemma": "<start_of_turn>user\nYou are a helpful assistant\n\nHello<end_of_turn>\n<start_of_turn>model\nHi there"
             "<end_of_turn>\n<start_of_turn>user\nWho are you<end_of_turn>\n<start_of_turn>model\nI am an assistant"
             "<end_of_turn>\n<start_of_turn>user\nAnother question<end_of_turn>\n<start_of_turn>model\n",
    "phi3": "<|system|>\nYou are a helpful assistant<|end|>\n<|user|>\nHello<|end|>\n<|assistant|>\nHi there<|end|>\n"
            "<|user|>\nWho are you<|end|>\n<|assistant|>\n   I am an assistant   <|end|>\n<|user|>\nAnother question"
            "<|end|>\n<|assistant|>\n",
    "phi4": "<|im_start|>system<|im_sep|>You are a helpful assistant<|im_end|><|im_start|>user<|im_sep|>Hello"
            "<|im_end|><|im_start|>assistant<|im_sep|>Hi there<|im_end|><|im_start|>user<|im_sep|>Who are you"
            "<|im_end|><|im_start|>assistant<|im_sep|>   I am an assistant   <|im_end|><|im_start|>user<|im_sep|>"
            "Another question<|im_end|><|im_start|>assistant<|im_sep|>",
    "mistral-v3": "[INST] You are a helpful assistant\n\nHello[/INST] Hi there</s>[INST] Who are you[/INST] I am an "
                  "assistant</s>[INST] Another question[/INST]",
    "mistral-v7": "[SYSTEM_PROMPT] You are a helpful assistant[/SYSTEM_PROMPT][INST] Hello[/INST] Hi there</s>[INST] "
                  "Who are you[/INST]    I am an assistant   </s>[INST] Another question[/INST]",
}


def conversation(kind: str) -> list[dict]:
    return {"plain": TURNS, "system": [SYSTEM, *TURNS], "tools": [SYSTEM, *TOOL_TURNS],
            "thinking": [SYSTEM, *THINKING]}[kind]


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    """A byte-level BPE (300 merges) over the corpus with every family's special tokens."""
    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256 + len(SPECIALS) + 300, special_tokens=SPECIALS,
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tok.to_str()


def model_folder(root: Path, tokenizer_json: str, template: str, bos: str, eos: str) -> Path:
    """An HF tokenizer folder (tokenizer.json + tokenizer_config.json with the template), as a build ships one."""
    root.mkdir()
    (root / "tokenizer.json").write_text(tokenizer_json)
    (root / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "chat_template": template}))
    return root


def transformers_ids(folder: Path, messages: list[dict], **variables: object) -> list[int]:
    from transformers import AutoTokenizer

    out = AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, add_generation_prompt=True,
                                                                    tokenize=True, return_dict=False, **variables)
    return list(out)


@pytest.mark.parametrize(("name", "kind", "variables"), CASES,
                         ids=[f"{n}-{k}-{'-'.join(f'{a}={b}' for a, b in v.items())}" for n, k, v in CASES])
def test_vendor_templates_render_as_transformers_does(name, kind, variables, tokenizer_json, tmp_path, vendor):
    bos, eos = FAMILIES[name]
    folder = model_folder(tmp_path / "m", tokenizer_json, (vendor / f"{name}.jinja").read_text(), bos, eos)
    messages = conversation(kind)
    tools = {"tools": TOOLS} if kind == "tools" else {}
    chat = ChatTokenizer(folder)
    if name == "google-gemma-2-2b-it" and kind == "system":  # Gemma 2 refuses a system turn: so does fleet
        from jinja2.exceptions import TemplateError

        with pytest.raises(TemplateError, match="System role not supported"):
            transformers_ids(folder, messages)
        with pytest.raises(InvalidRequest, match="System role not supported"):
            chat.render_chat(messages)
        return
    ids = chat.encode(chat.render_chat(messages, **tools, **variables))
    assert ids == transformers_ids(folder, messages, **tools, **variables)
    specials = {chat.tokenizer.token_to_id(t) for t in SPECIALS}
    assert len(specials & set(ids)) >= 2, chat.tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_builtin_templates_write_llama_cpp_builtins_prompts_as_transformers_renders_them(name, tokenizer_json,
                                                                                         tmp_path):
    found = builtin_template(set(SPECIALS) - {m for n, markers in MARKERS if n != name for m in markers}
                             | set(dict(MARKERS)[name]), add_bos=False)
    assert found == (name, TEMPLATES[name])
    folder = model_folder(tmp_path / "m", tokenizer_json, TEMPLATES[name], "<s>", "</s>")
    chat = ChatTokenizer(folder)
    text = chat.render_chat(LLAMA_CPP_CHAT)
    assert text == LLAMA_CPP_OUTPUT[name]
    assert chat.encode(text) == transformers_ids(folder, LLAMA_CPP_CHAT)


def test_builtin_template_is_chosen_by_the_vocabulary_s_markers():
    base = {"a", "b", "<s>", "</s>"}
    assert builtin_template(base | {"<|im_start|>", "<|im_end|>"}, add_bos=False) == ("chatml", TEMPLATES["chatml"])
    assert builtin_template(base | {"<|im_start|>", "<|im_end|>", "<|im_sep|>"}, add_bos=False)[0] == "phi4"
    name, template = builtin_template(base | {"[INST]", "[/INST]"}, add_bos=True)
    assert name == "mistral-v3" and template == "{{ bos_token }}" + TEMPLATES["mistral-v3"]
    assert builtin_template(base | {"[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"}, True)[0] == "mistral-v7"
    assert builtin_template(base | {"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"}, True)[0] == "llama3"
    assert builtin_template(base | {"<|user|>", "<|assistant|>", "<|end|>"}, False)[0] == "phi3"
    assert builtin_template(base | {"<start_of_turn>"}, add_bos=True) is None  # half a format is none
    assert builtin_template(list(base), add_bos=True) is None


def test_a_folder_transformers_saved_renders_its_chat_template_jinja(tokenizer_json, tmp_path, vendor):
    """transformers' save_pretrained writes the template to chat_template.jinja, not tokenizer_config.json; an
    older config names its tokens as AddedToken objects and keeps named templates in a list."""
    from transformers import PreTrainedTokenizerFast

    template = (vendor / "Qwen-Qwen3-0.6B.jinja").read_text()
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json), bos_token="<|endoftext|>",
                                  eos_token="<|im_end|>")
    tok.chat_template = template
    tok.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())
    messages = [SYSTEM, *TOOL_TURNS]
    chat = ChatTokenizer(tmp_path / "saved")
    assert chat.encode(chat.render_chat(messages, tools=TOOLS)) == transformers_ids(tmp_path / "saved", messages,
                                                                                    tools=TOOLS)
    old = model_folder(tmp_path / "old", tokenizer_json, "", "", "")
    (old / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": {"content": "<s>", "special": True},
        "eos_token": {"content": "</s>", "special": True},
        "chat_template": [{"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}"},
                          {"name": "tool_use", "template": "tools"}]}))
    assert ChatTokenizer(old).render_chat([{"role": "user", "content": "x"}]) == "<s>x</s>"


def test_a_template_sees_the_variables_transformers_gives_it(tokenizer_json, tmp_path):
    """tools and documents defined as None unless given, the unk and pad tokens beside bos and eos."""
    template = ("{{ tools is defined }} {{ tools is none }} {{ documents is none }} [{{ bos_token }}{{ eos_token }}"
                "{{ unk_token }}{{ pad_token }}] {% for m in messages %}{{ m['content'] }}{% endfor %}"
                "{% if tools %}{{ tools | length }}{% endif %}")
    folder = model_folder(tmp_path / "m", tokenizer_json, template, "<s>", "</s>")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"unk_token": "<bos>", "pad_token": "<eos>"}))
    chat = ChatTokenizer(folder)
    for tools in ({}, {"tools": TOOLS}):
        text = chat.render_chat(TURNS, **tools)
        assert chat.encode(text) == transformers_ids(folder, TURNS, **tools), text
    assert text.startswith("True False True [<s></s><bos><eos>]")
