"""fleet's built-in chat templates, for a GGUF file without ``tokenizer.chat_template``.

llama.cpp keeps a list of built-in chat formats (``src/llama-chat.cpp``: ``LLM_CHAT_TEMPLATES``, rendered by
``llm_chat_apply_template``) and falls back to chatml when a file has no template. fleet writes those formats as
Jinja (the coordinator renders only Jinja, ``coordinator/tokenizer.py``), each spelling out what
``llm_chat_apply_template`` writes for it, and picks one from the vocabulary's special tokens (a format needs its
markers as single tokens; the file's architecture does not decide it: SmolLM2 is a ``llama`` with chatml's
tokens). A file whose vocabulary has no known format's markers gets no template: chat requests are then refused
with an error saying so, completions still work. That includes Llama 2 and Mistral v0.1/v0.2 files, whose
``[INST]`` is plain text in a vocabulary they share: which of llama.cpp's llama2 or mistral-v1 prompts is meant
cannot be told from the file, and fleet does not guess (llama.cpp's chatml fallback would be wrong for both).

The templates offer no tools (no ``tools`` variable): the coordinator then puts the tools in a system prompt
(``coordinator/api/tools``, llama.cpp's polyfill). BOS is written by the template as ``bos_token`` when the file's
tokenizer adds BOS (``tokenizer.ggml.add_bos_token``): fleet encodes a rendered prompt without adding specials.
"""

from __future__ import annotations

from collections.abc import Collection

_CONTENT = "(message['content'] or '')"

CHATML = ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + " + _CONTENT
          + " + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{%- endif %}")
PHI4 = ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '<|im_sep|>' + " + _CONTENT
        + " + '<|im_end|>' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant<|im_sep|>' }}"
        "{%- endif %}")
LLAMA3 = ("{%- for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
          + _CONTENT + " | trim + '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
PHI3 = ("{%- for message in messages %}{{ '<|' + message['role'] + '|>\\n' + " + _CONTENT
        + " + '<|end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{%- endif %}")
# Gemma has no system turn: the system text (trimmed) opens the next user turn, then a blank line
GEMMA = ("{%- set ns = namespace(system='') %}{%- for message in messages %}{%- if message['role'] == 'system' %}"
         "{%- set ns.system = ns.system + " + _CONTENT + " | trim %}{%- else %}"
         "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
         "{{ '<start_of_turn>' + role + '\\n' }}{%- if ns.system and role != 'model' %}{{ ns.system + '\\n\\n' }}"
         "{%- set ns.system = '' %}{%- endif %}{{ " + _CONTENT + " | trim + '<end_of_turn>\\n' }}{%- endif %}"
         "{%- endfor %}{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{%- endif %}")
# Mistral v3 (v0.3, control tokens [INST] [/INST]): the system text opens the turn; answers trimmed
MISTRAL_V3 = ("{%- set ns = namespace(inside=false) %}{%- for message in messages %}{%- if not ns.inside %}"
              "{{ '[INST] ' }}{%- set ns.inside = true %}{%- endif %}{%- if message['role'] == 'system' %}"
              "{{ " + _CONTENT + " + '\\n\\n' }}{%- elif message['role'] == 'user' %}{{ " + _CONTENT
              + " + '[/INST]' }}{%- else %}{{ ' ' + " + _CONTENT + " | trim + eos_token }}"
              "{%- set ns.inside = false %}{%- endif %}{%- endfor %}")
# Mistral v7 (Mistral Large 2411, [SYSTEM_PROMPT] tokens)
MISTRAL_V7 = ("{%- for message in messages %}{%- if message['role'] == 'system' %}{{ '[SYSTEM_PROMPT] ' + "
              + _CONTENT + " + '[/SYSTEM_PROMPT]' }}{%- elif message['role'] == 'user' %}{{ '[INST] ' + "
              + _CONTENT + " + '[/INST]' }}{%- else %}{{ ' ' + " + _CONTENT + " + eos_token }}{%- endif %}"
              "{%- endfor %}")

TEMPLATES = {"chatml": CHATML, "phi4": PHI4, "llama3": LLAMA3, "phi3": PHI3, "gemma": GEMMA,
             "mistral-v3": MISTRAL_V3, "mistral-v7": MISTRAL_V7}  # llama.cpp's names for the same formats
# the special tokens each format needs, checked in this order (phi4 before chatml, v7 before v3)
MARKERS = (("llama3", ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
           ("gemma", ("<start_of_turn>", "<end_of_turn>")),
           ("phi4", ("<|im_start|>", "<|im_sep|>", "<|im_end|>")),
           ("chatml", ("<|im_start|>", "<|im_end|>")),
           ("phi3", ("<|user|>", "<|assistant|>", "<|end|>")),
           ("mistral-v7", ("[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]")),
           ("mistral-v3", ("[INST]", "[/INST]")))


def builtin_template(tokens: Collection[str], add_bos: bool) -> tuple[str, str] | None:
    """The built-in chat format for a vocabulary: ``(name, Jinja template)``, or None when ``tokens`` (the
    vocabulary's token strings; a set is fastest) hold no known format's markers. ``add_bos``: the tokenizer
    adds BOS, so the template starts with ``bos_token`` (as llama.cpp tokenizes its prompt)."""
    vocab = tokens if isinstance(tokens, (set, frozenset, dict)) else set(tokens)
    for name, markers in MARKERS:
        if all(marker in vocab for marker in markers):
            return name, ("{{ bos_token }}" if add_bos else "") + TEMPLATES[name]
    return None
