"""Loading causal LMs from local directories (never from a hub) and the small helpers around them."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from common.memory import checkpoint_bytes, describe, memory_report

log = logging.getLogger("starsd.models")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelLoadError(RuntimeError):
    """A model directory that cannot be used, with a message saying why."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object | None
    path: Path
    device: torch.device
    dtype: torch.dtype  # the activations' dtype
    dtype_name: str  # the concrete --dtype served (never "auto"): fp16-weights computes in float32
    vocab_size: int  # tokens the tokenizer knows (the ids both sides may exchange)
    logits_size: int  # width of the model's output layer (may be padded beyond vocab_size)
    feature_size: int  # width of the final hidden state the output layer reads
    fingerprint: str
    eos_token_ids: frozenset[int]
    weights_bytes: int = 0  # the checkpoint's weight files: what resident memory is measured against

    @property
    def num_layers(self) -> int:
        """Decoder layers (0 when the config does not say): which fused features it can give."""
        cfg = self.model.config.get_text_config(decoder=True)  # a multimodal config nests its decoder's
        n = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
        return int(n) if isinstance(n, int) else 0


def resolve_device(name: str) -> torch.device:
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {name!r} requested but CUDA is not available on this machine")
    return dev


DTYPE_CHOICES = ("auto", "float32", "float16", "bfloat16", "fp16-weights")
DTYPE_HELP = ("Model dtype. auto: on a CPU the fastest exact format, fp16-weights where PyTorch has fbgemm "
              "(x86, and PyPI's aarch64 builds; float32 where a linear weight exceeds float16's range) and "
              "float32 elsewhere; on CUDA bfloat16 or float16 (not token-exact at near-ties); the log says what "
              "it picked and why. fp16-weights (CPUs, with fbgemm): "
              "linear weights held in float16 and multiplied in float32 by fbgemm: faster, and a forward over "
              "a few tokens costs about one token's (what speculation needs); the model is then the checkpoint "
              "with its linear weights rounded to float16. bfloat16 on a CPU that computes it: linear weights "
              "packed once for oneDNN; a generation verified on its own gets each row's bits from a one-row "
              "step, up to the rows a start-up check finds exact (logged; e.g. 25 on one thread, 11 on two for "
              "a 1.5B model), so its speculation keeps exactly the tokens of the target alone in bfloat16. "
              "Larger rounds, generations verified together, --compile and --no-lean run one pass and may "
              "differ at near-ties. bfloat16 on a CPU without bfloat16 units (AVX2): linear layers held for "
              "fbgemm with their bfloat16 values, float32 sums (about 1.5x faster a step than converting "
              "as it goes, 5x a five-row verification); rows round with the rows beside them.")


@dataclass(frozen=True)
class DtypeChoice:
    """A concrete ``--dtype`` (never ``auto``) and why it was taken."""

    name: str
    reason: str


def choose_dtype(name: str, device: torch.device) -> DtypeChoice:
    """What ``--dtype NAME`` means on ``device``: an explicit choice stands; ``auto`` on a CPU is
    the fastest format whose greedy outputs are the target alone's, and on CUDA the 16-bit format
    the GPU computes natively (bfloat16's near-ties are the known exception to exactness there).
    Where PyTorch has fbgemm (x86 builds, and PyPI's aarch64 ones) that is fp16-weights: it
    computes in float32 (a many-row verification and a one-row step round alike) and moves half the
    weight bytes; bfloat16's coarse logits break near-ties differently wherever a row's bits depend
    on the rows beside it, which ``common.lean.row_exact_rows`` rules out only for a generation
    verified on its own, within the rows it checks. A checkpoint whose linear weights overflow float16 is taken back to float32 at load
    (``load_causal_lm``), where the weights can be counted."""
    from common.fp16_weights import FP16_WEIGHTS, fp16_weights_available

    if name != "auto":
        return DtypeChoice(name, "asked for")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return DtypeChoice("bfloat16", "auto on CUDA with bfloat16 support")
        return DtypeChoice("float16", "auto on CUDA without bfloat16 support")
    if device.type == "cpu" and fp16_weights_available():
        return DtypeChoice(FP16_WEIGHTS, f"auto on a {platform.machine()} CPU with fbgemm: float16 weights, float32 "
                                         "arithmetic, exact and about twice float32's speed on x86")
    return DtypeChoice("float32", f"auto on {device.type} without fbgemm (fp16-weights needs PyTorch's fbgemm "
                                  "kernels): float32 is exact where bfloat16 is not")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The activations' dtype for a ``--dtype`` choice (fp16-weights computes in float32)."""
    from common.fp16_weights import FP16_WEIGHTS, fp16_weights_available

    name = choose_dtype(name, device).name
    if name == FP16_WEIGHTS:
        if device.type != "cpu":
            raise ModelLoadError(f"--dtype {FP16_WEIGHTS} is a CPU format; on {device} use bfloat16 or float16")
        if not fp16_weights_available():
            raise ModelLoadError(f"--dtype {FP16_WEIGHTS} needs PyTorch's fbgemm kernels (x86 builds, PyPI's aarch64 "
                                 "ones), which this "
                                 f"build lacks ({torch.backends.quantized.supported_engines}); use float32")
        return torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPE_CHOICES)}") from None


def tokenizer_fingerprint(tokenizer, fallback_vocab: int) -> str:
    """A short hash of the token-to-id mapping and special tokens: equal fingerprints mean
    token ids mean the same text on both sides."""
    if tokenizer is None:
        return f"vocab-only-{fallback_vocab}"
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = {k: getattr(tokenizer, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    blob = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(path: Path):
    """The tokenizer saved in a model directory, or None (with a warning) when it has none."""
    from transformers import AutoTokenizer

    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        log.warning("%s has no tokenizer; the handshake can only compare vocabulary sizes", path)
        return None
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {exc}") from exc


def vocab_size(tokenizer, logits_size: int) -> int:
    """Token ids both sides may exchange: those the tokenizer knows, within the output layer."""
    return min(len(tokenizer) if tokenizer is not None else logits_size, logits_size)


def tokenizer_identity(model_dir: Path, logits_size: int) -> tuple[int, str]:
    """(vocabulary size, fingerprint) of a model directory without loading its weights: what the
    handshake compares, computed as load_causal_lm computes it."""
    tokenizer = load_tokenizer(Path(model_dir))
    vocab = vocab_size(tokenizer, logits_size)
    return vocab, tokenizer_fingerprint(tokenizer, vocab)


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    gen_cfg = getattr(model, "generation_config", None)
    for src in (getattr(gen_cfg, "eos_token_id", None), getattr(model.config, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


# ---------------------------------------------------------------- the built-in demo checkpoints
DEMO_RECIPE = "smollm2-v3"  # the demo builder's recipe: a new recipe is a new cache directory
DEMO_CHECKPOINTS = {"demo": "target", "demo-draft": "draft", "demo-eagle": "eagle", "demo-eagle3": "eagle3"}
DEMO_BUILD_COMMAND = "starsd-draftd demo --prepare"
DEMO_BUILD_COMMANDS = {"demo": DEMO_BUILD_COMMAND, "demo-draft": DEMO_BUILD_COMMAND,
                       "demo-eagle": "starsd-draftd demo --backend eagle --prepare",
                       "demo-eagle3": "starsd-draftd demo --backend eagle3 --prepare"}


def cache_root() -> Path:
    """``$STARSD_CACHE_DIR``, else ``$XDG_CACHE_HOME/starsd``, else ``~/.cache/starsd``."""
    explicit = os.environ.get("STARSD_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "starsd"
    return Path.home() / ".cache" / "starsd"


def demo_dir() -> Path:
    """The directory holding this recipe's demo checkpoints (``target``, ``draft``, ``eagle``, ``eagle3``)."""
    return cache_root() / f"demo-{DEMO_RECIPE}"


def resolve_model_path(name_or_dir: str) -> Path:
    """A checkpoint directory: ``demo``, ``demo-draft``, ``demo-eagle`` and ``demo-eagle3`` name the cached demo
    checkpoints (never built here: a missing one is a ModelLoadError naming the command that
    builds it); anything else is returned as a path, unchecked."""
    sub = DEMO_CHECKPOINTS.get(name_or_dir)
    if sub is None:
        return Path(name_or_dir)
    path = demo_dir() / sub
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"the built-in demo checkpoint {name_or_dir!r} is not built yet (looked in {path}); "
                             f"build it once with `{DEMO_BUILD_COMMANDS[name_or_dir]}` (as the user whose "
                             "STARSD_CACHE_DIR the daemon reads)")
    return path


def load_causal_lm(name_or_path: str, device: str = "cpu", dtype: str = "float32", draft_vocab=None) -> LoadedModel:
    """Load a Hugging Face causal LM (and its tokenizer, when the directory has one) from a
    local directory, or one of the cached demo checkpoints (``demo`` / ``demo-draft``).
    ``dtype``: a ``--dtype`` choice; library callers get the checkpoint in float32 unless they ask,
    the daemons pass theirs (``auto`` by default: see ``choose_dtype``).
    ``draft_vocab`` (a ``common.draft_vocab.DraftVocab``): cut the output layer to its ids."""
    from transformers import AutoModelForCausalLM

    from common.fp16_weights import FP16_WEIGHTS

    path = resolve_model_path(name_or_path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"{path} is not a model directory (no config.json); pass a local Hugging Face checkpoint "
            "directory, or 'demo' / 'demo-draft' for the built-in pair"
        )
    dev = resolve_device(device)
    choice = choose_dtype(dtype, dev)
    torch_dtype = resolve_dtype(choice.name, dev)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    log.info("loading model %s on %s as %s (%s)", path, dev, choice.name, choice.reason)
    # fp16-weights is built from the checkpoint's own dtype, one layer at a time (pack_model):
    # loading a bfloat16 checkpoint as float32 first would double its weights' memory at the peak
    load_dtype = "auto" if choice.name == FP16_WEIGHTS else torch_dtype
    t0 = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=load_dtype, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load a causal LM from {path}: {exc}") from exc
    model.to(dev).eval()
    tokenizer = load_tokenizer(path)
    head = model.get_output_embeddings().weight
    logits_size, feature_size = int(head.shape[0]), int(head.shape[1])
    vocab = vocab_size(tokenizer, logits_size)
    fingerprint = tokenizer_fingerprint(tokenizer, vocab)
    if draft_vocab is not None:  # before packing: the kept rows are copied out of the full layer
        from common.draft_vocab import restrict_head

        draft_vocab.check(logits_size, fingerprint, vocab)
        restrict_head(model, draft_vocab)
        log.info("output layer cut to %d of %d token ids (%s)", len(draft_vocab.ids), logits_size,
                 draft_vocab.path or "given ids")
    if choice.name == FP16_WEIGHTS:
        choice = _pack_fp16_weights(model, choice, path, asked=dtype != "auto")
    elif torch_dtype == torch.bfloat16 and dev.type == "cpu":
        _pack_bf16(model)
    weights = checkpoint_bytes(path)
    log.info("loaded %s in %.1f s: %s", path.name, time.perf_counter() - t0, describe(memory_report(weights)))
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        path=path,
        device=dev,
        dtype=torch_dtype,
        dtype_name=choice.name,
        vocab_size=vocab,
        logits_size=logits_size,
        feature_size=feature_size,
        fingerprint=fingerprint,
        eos_token_ids=_eos_ids(model, tokenizer),
        weights_bytes=weights,
    )


def fp16_range_refusal(module: torch.nn.Module, where: Path, asked: bool, extra: tuple[torch.Tensor, ...] = ()
                       ) -> str | None:
    """Why ``module``'s linear weights (and the ``extra`` weights to be packed beside them) cannot
    be served as fp16-weights (some exceed float16's range), or None when they all fit: an explicit
    ``--dtype fp16-weights`` is refused with the count (ModelLoadError); under ``auto`` the reason
    comes back, and the caller serves float32."""
    from common.fp16_weights import FP16_MAX, linears_beyond_fp16

    over, total = linears_beyond_fp16(module)
    for w in extra:
        over, total = over + int(torch.count_nonzero(w.detach().abs() > FP16_MAX)), total + w.numel()
    if not over:
        return None
    why = f"{over} of {total} linear weights in {where} exceed float16's range (|w| > {FP16_MAX:g}) and would become infinite"
    if asked:
        raise ModelLoadError(f"--dtype fp16-weights: {why}; use float32 or bfloat16")
    log.warning("dtype auto: %s; serving float32 instead", why)
    return why


def _pack_fp16_weights(model: torch.nn.Module, choice: DtypeChoice, path: Path, asked: bool) -> DtypeChoice:
    """Pack ``model`` (loaded in its checkpoint's dtype) for fp16-weights, unless some weights do
    not fit float16 (``fp16_range_refusal``): then it serves float32."""
    from common.fp16_weights import pack_model

    why = fp16_range_refusal(model, path, asked)
    if why is not None:
        model.float()
        return DtypeChoice("float32", f"auto: {why}")
    log.info("%d linear layers packed with float16 weights for fbgemm (all within float16's range)", pack_model(model))
    return choice


def _pack_bf16(model: torch.nn.Module) -> None:
    """Pack a bfloat16 model's linear weights for oneDNN (``common.bf16_packed``), where this CPU
    can run them; the plain weights' file pages are given back as each layer is packed."""
    from common.bf16_packed import BF16_FBGEMM_ENV, pack_bf16, pack_bf16_fbgemm, packed_bf16_available
    from common.fp16_weights import bf16_matrix_units, fp16_weights_available
    from common.memory import give_back_freed_memory, release_file_pages, weight_file_ranges
    from common.switches import switched_off

    ranges = weight_file_ranges()
    units, packed = bf16_matrix_units(), packed_bf16_available()
    why_not = ("" if units else "oneDNN's packed kernel is here, its rows exact" if packed
               else "this build has no fbgemm" if not fp16_weights_available()
               else f"{platform.machine()} is not x86" if platform.machine().lower() not in ("x86_64", "amd64")
               else f"{BF16_FBGEMM_ENV}=0" if switched_off(BF16_FBGEMM_ENV) else None)
    if why_not is None:  # an x86 CPU with neither bfloat16 units nor oneDNN's packed kernel (AVX2)
        n, inexact, total = pack_bf16_fbgemm(model, done=lambda weight: release_file_pages(weight, ranges))
        give_back_freed_memory()
        log.info("%d bfloat16 linear layers held for fbgemm (this CPU has no bfloat16 units: AMX or AVX-512 BF16); "
                 "%d of %d weights lie more than 2**32 below their row's largest and are rounded to float16's "
                 "resolution there", n, inexact, total)
        return
    if why_not:
        # the demo target on a 2-vCPU AVX2 server: 47 against 24 ms a step, 154 against 32 ms for five rows
        log.warning("--dtype bfloat16 on a CPU without bfloat16 matrix instructions (AMX or AVX-512 BF16), its "
                    "layers not held for fbgemm (%s): its products are converted to float32 as they go, "
                    "a step takes about twice as long as in fp16-weights and a verification of five rows "
                    "about 5x", why_not)
    if not packed_bf16_available():
        log.info("bfloat16 linear layers stay plain: this CPU or PyTorch build has no packed bfloat16 kernel")
        return
    n, why = pack_bf16(model, done=lambda weight: release_file_pages(weight, ranges))
    if why is not None:
        log.warning("bfloat16 linear layers stay plain: %s", why)
        return
    give_back_freed_memory()
    log.info("%d bfloat16 linear layers packed for oneDNN", n)


def context_length(model) -> int | None:
    """The most positions the model was built for (its config's ``max_position_embeddings``,
    which GPT-2's ``n_positions`` maps to), or None when its config declares none."""
    n = getattr(model.config, "max_position_embeddings", None)
    return n if isinstance(n, int) and n > 0 else None


def kv_bytes_per_token(config, dtype: torch.dtype, layers: int | None = None) -> int:
    """Bytes one position occupies in a KV cache of this architecture (keys and values of every
    layer, or of ``layers``), from its config: what a session's cache grows by per token."""
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", 1)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    n = layers if layers is not None else getattr(config, "num_hidden_layers", None) or config.n_layer
    return 2 * n * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def new_cache(model, capacity: int = 0):
    """An empty in-place KV cache for ``model`` (``common.slot_cache.SlotCache``), with
    ``capacity`` positions preallocated (0: grown as needed)."""
    from common.slot_cache import SlotCache

    return SlotCache(model.config, capacity)


def crop_cache(cache, length: int) -> None:
    """Roll a cache back so that it holds exactly ``length`` positions."""
    have = cache.get_seq_length()
    if length < 0 or length > have:
        raise ValueError(f"cannot crop a cache of {have} positions to {length}")
    if have > length:
        cache.crop(length - have)  # a negative count removes that many positions


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] holds, a[:hi] == b[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def cpu_count() -> int:
    """Cores this process may run on (its CPU affinity where the platform tells, else all)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def set_torch_threads(n: int) -> None:
    """``n`` torch CPU threads; 0: one per core this process may run on (a daemon pinned to some
    cores gets as many threads)."""
    torch.set_num_threads(n if n > 0 else cpu_count())


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run a block with ``n`` torch CPU threads, restoring the previous count afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
