"""fleet-compiler needs no torch and no transformers: ``pip install .[compile]`` pulls neither, and a build
runs with both blocked from import."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {"torch", "transformers", "accelerate", "optimum", "optimum-intel", "torchvision"}


def _name(requirement: str) -> str:
    return re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def dependency_closure(requirements: list[str]) -> set[str]:
    """Every distribution ``requirements`` pull in, from this environment's installed metadata (extras of
    the dependencies are not followed, as pip does not install them unless asked)."""
    seen: set[str] = set()
    todo = [r for r in requirements if "extra ==" not in r]
    while todo:
        name = _name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = distribution(name).requires or []
        except PackageNotFoundError:
            continue
        todo += [r for r in requires if "extra ==" not in r]
    return seen


def test_compile_extra_pulls_no_torch():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    closure = dependency_closure([*project["dependencies"], *project["optional-dependencies"]["compile"]])
    assert "openvino" in closure and "nncf" in closure and "safetensors" in closure
    assert not closure & FORBIDDEN, sorted(closure & FORBIDDEN)


# torch and friends look absent (a spec without origin, as NNCF's probe sees an uninstalled package) and
# fail if anything imports them.
BLOCKED_BUILD = """
import importlib.abc, importlib.machinery, sys
class Block(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'transformers', 'accelerate', 'optimum'):
            return importlib.machinery.ModuleSpec(name, self, origin=None)
    def create_module(self, spec):
        raise ImportError('blocked for this test: ' + spec.name)
    def exec_module(self, module):
        pass
sys.meta_path.insert(0, Block())
from compiler.cli import main
sys.exit(main(sys.argv[1:]))
"""


def tiny_llama(folder: Path, hidden: int = 32, intermediate: int = 64, vocab: int = 100, kv_rows: int = 16,
               tied: bool = False, std: float = 0.1, seed: int = 0) -> Path:
    """A 2-layer random Llama written with numpy alone (config.json + model.safetensors + tokenizer.json): 4
    heads, 2 KV heads of ``kv_rows // 2``, N(0, ``std``) f32 weights, the head tied to the embedding if ``tied``."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models

    h, i, v, layers = hidden, intermediate, vocab, 2
    rng = np.random.default_rng(seed)
    tensors = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)} | ({} if tied else
                                                                                  {"lm_head.weight": (v, h)})
    for n in range(layers):
        p = f"model.layers.{n}."
        tensors |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv_rows, h),
                    p + "self_attn.v_proj.weight": (kv_rows, h), p + "self_attn.o_proj.weight": (h, h),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i)}
    folder.mkdir(parents=True)
    save_file({k: (rng.standard_normal(s) * std).astype(np.float32) for k, s in tensors.items()},
              str(folder / "model.safetensors"))
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": h,
              "intermediate_size": i, "num_hidden_layers": layers, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": v, "rms_norm_eps": 1e-5, "max_position_embeddings": 128,
              "tie_word_embeddings": tied, "eos_token_id": 2}
    (folder / "config.json").write_text(json.dumps(config))
    Tokenizer(models.WordLevel({f"w{n}": n for n in range(v)}, unk_token="w0")).save(str(folder / "tokenizer.json"))
    return folder


def test_build_runs_with_torch_and_transformers_blocked(tmp_path):
    src = tiny_llama(tmp_path / "tiny")
    out = subprocess.run([sys.executable, "-c", BLOCKED_BUILD, "build", str(src), "--shards", "2", "--weights",
                          "int8", "-o", str(tmp_path / "build")], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    manifest = json.loads((tmp_path / "build" / "manifest.json").read_text())
    assert [(s["start"], s["end"], s["weights"]) for s in manifest["stages"]] == [(0, 1, "int8"), (1, 2, "int8")]
