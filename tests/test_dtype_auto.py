"""--dtype auto: the fastest exact format for the device, said in the log, and refused or
taken back where a checkpoint's weights do not fit float16."""

import copy
import gc
import logging
import os
import platform
import re

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from common import fp16_weights
from common.fp16_weights import FP16_WEIGHTS, Fp16Linear, fp16_weights_available
from common.models import ModelLoadError, choose_dtype, load_causal_lm
from tiny_models import EOS_ID, PAD_ID, mapped_resident_kib

needs_fbgemm = pytest.mark.skipif(not fp16_weights_available(),
                                  reason="fbgemm is x86-only; auto picks fp16-weights only on an x86 build of PyTorch")
CPU = torch.device("cpu")
needs_proc_maps = pytest.mark.skipif(not os.path.exists("/proc/self/maps"),
                                     reason="reads this process's mappings from Linux's /proc")


def test_auto_on_a_cpu_with_fbgemm_is_fp16_weights_and_without_it_float32(monkeypatch):
    monkeypatch.setattr(fp16_weights, "fp16_weights_available", lambda: True)
    assert choose_dtype("auto", CPU).name == FP16_WEIGHTS
    monkeypatch.setattr(fp16_weights, "fp16_weights_available", lambda: False)
    picked = choose_dtype("auto", CPU)
    assert picked.name == "float32" and "fbgemm" in picked.reason
    for explicit in ("float32", "bfloat16", "float16", FP16_WEIGHTS):  # an explicit choice stands
        assert choose_dtype(explicit, CPU).name == explicit


def test_auto_on_cuda_follows_bfloat16_support(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert choose_dtype("auto", torch.device("cuda")).name == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert choose_dtype("auto", torch.device("cuda")).name == "float16"


@needs_fbgemm
def test_auto_loads_fp16_weights_and_says_why(tiny_target, caplog):
    with caplog.at_level(logging.INFO, logger="starsd.models"):
        loaded = load_causal_lm(str(tiny_target), dtype="auto")
    assert loaded.dtype_name == FP16_WEIGHTS and loaded.dtype == torch.float32
    assert any(isinstance(m, Fp16Linear) for m in loaded.model.modules())
    assert not any(isinstance(m, torch.nn.Linear) for m in loaded.model.modules())
    text = caplog.text
    assert f"as fp16-weights (auto on a {platform.machine()} CPU with fbgemm" in text
    assert "within float16's range" in text


def _with_a_huge_weight(src, out, dtype=torch.float32):
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = 1.0e5  # beyond float16's 65504
        model.model.layers[0].mlp.down_proj.weight[1, 2] = -7.0e4
    model.to(dtype).save_pretrained(out)
    return out


@needs_fbgemm
def test_weights_beyond_float16_make_auto_serve_float32_and_an_explicit_choice_fail(tiny_target, tmp_path, caplog):
    wide = _with_a_huge_weight(tiny_target, tmp_path / "wide")
    with caplog.at_level(logging.WARNING, logger="starsd.models"):
        loaded = load_causal_lm(str(wide), dtype="auto")
    assert loaded.dtype_name == "float32"
    assert not any(isinstance(m, Fp16Linear) for m in loaded.model.modules())
    assert "2 of " in caplog.text and "exceed float16's range" in caplog.text
    with pytest.raises(ModelLoadError, match=r"2 of \d+ linear weights .* exceed float16's range"):
        load_causal_lm(str(wide), dtype=FP16_WEIGHTS)


def _rounded_reference(model_dir):
    """What fp16-weights serves, built the plain way: the checkpoint read as float32, its linear
    weights rounded to float16 (a tied output layer is the embedding table, unrounded, as the
    lookup keeps it: only the output layer's own copy is rounded)."""
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if ref.config.tie_word_embeddings:
        head = ref.get_output_embeddings()
        head.weight = torch.nn.Parameter(head.weight.detach().clone())  # untie: round the head's copy only
    with torch.no_grad():
        for m in ref.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(m.weight.half().float())
    return ref


@needs_fbgemm
@pytest.mark.parametrize("saved,tied", [(torch.bfloat16, True), (torch.float16, False)], ids=["bf16-tied", "fp16"])
def test_a_16bit_checkpoint_is_packed_from_its_own_dtype_and_keeps_its_values(tmp_path, saved, tied):
    """fp16-weights built from a bfloat16 or float16 checkpoint one layer at a time: the
    embedding table stays 16-bit (no float32 copy), everything else computes in float32, and the
    logits are bit for bit those of fp16-weights built from the same values saved as float32; a
    tied output layer included. Against the plain float32 model with its linear weights rounded
    to float16 they agree to float32 rounding only: fbgemm and the float32 GEMM sum in different
    orders on some CPUs (AVX2 ones)."""
    from common.fp16_weights import CompactEmbedding
    from tiny_models import make_tiny_checkpoint

    src = make_tiny_checkpoint(tmp_path / "src", "llama", seed=5, hidden=48, layers=2, tied=tied)
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).to(saved).save_pretrained(tmp_path / "ckpt")
    loaded = load_causal_lm(str(tmp_path / "ckpt"), dtype="auto")
    assert loaded.dtype_name == FP16_WEIGHTS and loaded.model.config.tie_word_embeddings == tied
    embed = loaded.model.get_input_embeddings()
    assert isinstance(embed, CompactEmbedding) and embed.weight.dtype == saved
    others = [(n, p.dtype) for n, p in loaded.model.named_parameters() if "embed_tokens" not in n]
    assert others and all(d == torch.float32 for _, d in others), others
    AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).save_pretrained(tmp_path / "wide")
    same = load_causal_lm(str(tmp_path / "wide"), dtype=FP16_WEIGHTS)
    assert same.model.get_input_embeddings().weight.dtype == torch.float32  # the 32-bit path, for contrast
    ref = _rounded_reference(tmp_path / "ckpt")
    ids = torch.tensor([[1, 5, 9, 30, 2, 77]])
    with torch.inference_mode():
        got, exact, want = (m(input_ids=ids).logits for m in (loaded.model, same.model, ref))
    assert got.dtype == torch.float32 and torch.equal(got, exact), (got - exact).abs().max()
    # the weights' values, not only the kernel's arithmetic: a weight rounded otherwise moves
    # the logits by far more than summation order does
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@needs_fbgemm
def test_a_tied_bfloat16_checkpoint_in_fp16_weights_decodes_as_its_rounded_self(tmp_path):
    """Through the engine the daemons run (the lean forward, fused and scripted where it can),
    a tied bfloat16 checkpoint served as fp16-weights decodes greedily as the rounded checkpoint's
    own generate does, and speculation over it (its own weights as the draft) is exact."""
    from common.verify import SamplingParams
    from fakes import running_server, speculate
    from starsd_draftd.backends.model import ModelBackend
    from starsd_target.client import DraftClient
    from starsd_target.engine import TargetEngine
    from tiny_models import make_tiny_checkpoint

    src = make_tiny_checkpoint(tmp_path / "src", "qwen2", seed=6, hidden=48, layers=2, tied=True)
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).to(torch.bfloat16).save_pretrained(tmp_path / "b")
    for f in src.glob("*token*"):
        (tmp_path / "b" / f.name).write_bytes(f.read_bytes())
    target = load_causal_lm(str(tmp_path / "b"), dtype="auto")
    engine = TargetEngine(target, depth=4)
    assert engine.runner.forward_kind == "lean"
    prompt = engine.encode("def parse(line):\n    ")
    ref = _fp16_rounded_greedy(tmp_path / "b", prompt, 40)
    assert len(set(ref)) > 3  # not one token over and over: the check has something to compare
    assert engine.generate(prompt, 40, SamplingParams()).token_ids == ref
    backend = ModelBackend(load_causal_lm(str(tmp_path / "b"), dtype="auto"))
    with running_server(backend) as (server, ctx):
        client = DraftClient(server.endpoint, target.vocab_size, target.fingerprint, ctx=ctx)
        client.handshake(10)
        r = speculate(engine, client, prompt, 40, SamplingParams(), 30)
        client.close()
    assert r.token_ids == ref and r.stats.accepted > 0 and r.stats.fallback_rounds == 0


def test_memory_report_reads_this_process_and_the_checkpoint(tiny_target):
    from common.memory import checkpoint_bytes, describe, memory_report

    weights = checkpoint_bytes(tiny_target)
    assert weights == sum(f.stat().st_size for f in tiny_target.glob("*.safetensors")) > 0
    report = memory_report(weights)
    assert 0 < report["rss_bytes"] <= report["peak_rss_bytes"]
    assert report["rss_over_weights"] == round(report["rss_bytes"] / weights, 3)
    assert "x the checkpoint's" in describe(report)
    assert memory_report(0)["rss_over_weights"] is None and "checkpoint" not in describe(memory_report(0))


def _fp16_rounded_greedy(model_dir, prompt_ids, n):
    """What fp16-weights serves, decoded the plain way: the rounded checkpoint
    (``_rounded_reference``) through the model's own generate."""
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = _rounded_reference(model_dir).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                                     do_sample=False, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    return out[0, len(prompt_ids):].tolist()


@needs_fbgemm
@pytest.mark.slow
def test_daemons_with_their_default_dtype_serve_fp16_weights_exactly_and_speculate(star, tiny_target, near_draft,
                                                                                 monkeypatch):
    """Both daemons as a user starts them, no --dtype: fp16-weights, said in their logs; greedy
    output equals the fp16-rounded checkpoint's own generate, with drafts kept and no fallback."""
    from fakes import run_concurrently
    from starsd_target.engine import TargetEngine

    monkeypatch.delenv("STARSD_TARGET_DTYPE", raising=False)
    monkeypatch.delenv("STARSD_DRAFTD_DTYPE", raising=False)
    assert "STARSD_TARGET_DTYPE" not in os.environ
    draft_ep = star.draftd(near_draft)
    (target_ep,) = star.targets(tiny_target, draft_ep, 1, "--connect-timeout", "120", "--draft-timeout", "30")
    for name in ("draftd", "t0"):
        assert f"as fp16-weights (auto on a {platform.machine()} CPU" in star.log(name), star.log(name)[-2000:]
    prompt = "def parse(line):\n    "
    ids = TargetEngine(load_causal_lm(str(tiny_target))).encode(prompt)
    ref = _fp16_rounded_greedy(tiny_target, ids, 40)
    (res,) = run_concurrently([target_ep], [{"id": 1, "prompt": prompt, "max_tokens": 40}])
    assert res["token_ids"] == ref
    assert res["stats"]["fallback_rounds"] == 0
    assert res["stats"]["accepted"] > 0 and res["stats"]["rounds"] < len(ref)


@needs_proc_maps
def test_released_file_pages_read_back_the_same_and_other_memory_is_never_touched(tmp_path):
    import mmap

    from common.memory import populate_file_pages, release_file_pages, weight_file_ranges

    data = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    path = tmp_path / "w.safetensors"
    path.write_bytes(data.numpy().tobytes())
    with open(path, "r+b") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private, as a loaded checkpoint's
    view = torch.frombuffer(mapped, dtype=torch.float32)
    assert torch.equal(view, data)  # every page touched: resident
    ranges = weight_file_ranges()
    assert any(lo <= view.data_ptr() < hi for lo, hi in ranges)
    assert release_file_pages(view, ranges) == view.numel() * 4  # page-aligned: all of it
    assert torch.equal(view, data)  # paged in again from the file
    assert release_file_pages(data, ranges) == 0  # not a mapped weight file: left alone
    assert torch.equal(data, torch.arange(1 << 20, dtype=torch.float32))
    # mapped again in one call (a wide prefill's first read), where the kernel can: resident, the same bytes
    assert release_file_pages(view, ranges) == view.numel() * 4 and mapped_resident_kib(path) == 0
    populated = populate_file_pages(view, ranges)
    if populated:  # the kernel took the advice (Linux 5.14+): all of it mapped at once
        assert populated == view.numel() * 4 and mapped_resident_kib(path) == 4096
    else:  # refused (an older kernel): reading faults the pages in as ever
        assert not re.match(r"(\d+)\.(\d+)", platform.release()) or tuple(
            int(x) for x in re.match(r"(\d+)\.(\d+)", platform.release()).groups()) < (5, 14)
    assert torch.equal(view, data)
    assert populate_file_pages(data, ranges) == 0
    del view
    mapped.close()


@needs_fbgemm
@needs_proc_maps
def test_fp16_weights_keeps_of_the_checkpoint_file_only_the_embedding_rows_looked_up(tmp_path):
    """Loaded in its own dtype, a checkpoint's tensors start as views of its mapped file. After
    packing, what is left of them (the 16-bit embedding table, which a tied output layer shares
    while its packed layer holds its own float16 copy, and the linear weights a wide prefill
    reads) leaves none of its pages resident, and lookups read their rows from the file
    (``FileRows``) rather than through the mapping, whose faults would bring in their
    neighbours too (64 KiB of fault-around, or a whole large page-cache folio): rows looked up
    all over the table leave it as little resident as before, and are the checkpoint's."""
    from common.memory import weight_file_ranges
    from tiny_models import make_tiny_checkpoint

    src = make_tiny_checkpoint(tmp_path / "src", "llama", seed=3, hidden=1024, layers=1, tied=True)
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    path = tmp_path / "bf16" / "model.safetensors"
    loaded = load_causal_lm(str(tmp_path / "bf16"), dtype=FP16_WEIGHTS)
    assert loaded.weights_bytes == path.stat().st_size
    table = loaded.model.get_input_embeddings().weight
    assert table.dtype == torch.bfloat16 and table.numel() * 2 > 128 * 4096  # 259 rows of 2 KiB
    assert any(lo <= table.data_ptr() < hi for lo, hi in weight_file_ranges())

    # the header and the small tensors read (with the pages the kernel maps beside them): not the table's 518 KiB
    assert mapped_resident_kib(path) <= 128
    embed = loaded.model.get_input_embeddings()
    assert embed.rows is not None
    ids = torch.arange(0, table.shape[0], 8)[:32].reshape(2, -1)  # a row in every 16 KiB of the table
    with torch.inference_mode():
        rows = embed(ids)
    assert mapped_resident_kib(path) <= 128  # through the mapping: about all of its 518 KiB
    assert rows.dtype == torch.float32 and rows.shape == (*ids.shape, table.shape[1])
    assert torch.equal(rows, load_file(path)["model.embed_tokens.weight"][ids].float())
    with pytest.raises(IndexError):
        embed(torch.tensor([[1, table.shape[0]]]))
    with pytest.raises(IndexError):
        embed(torch.tensor([-1]))


@needs_fbgemm
@pytest.mark.parametrize("units, switch", [(False, ""), (False, "0"), (True, "")])
def test_bfloat16_without_bfloat16_units_is_held_for_fbgemm_or_loaded_with_a_warning(tiny_target, caplog,
                                                                                      monkeypatch, units, switch):
    """On a CPU that would convert bfloat16 products to float32 as they go, bfloat16 layers are
    held for fbgemm (``Bf16FbgemmLinear``) and the log says so; with that switched off the user
    is warned; with bfloat16 units neither happens."""
    from common import bf16_packed, fp16_weights
    from common.bf16_packed import BF16_FBGEMM_ENV, Bf16FbgemmLinear

    monkeypatch.setattr(fp16_weights, "bf16_matrix_units", lambda: units)
    monkeypatch.setattr(bf16_packed, "packed_bf16_available", lambda: False)  # (AVX2: as on a Xeon without AMX)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setenv(BF16_FBGEMM_ENV, switch)
    with caplog.at_level(logging.INFO, logger="starsd.models"):
        loaded = load_causal_lm(str(tiny_target), dtype="bfloat16")
    assert loaded.dtype_name == "bfloat16"
    said = [r.getMessage() for r in caplog.records]
    warned = [m for m in said if "without bfloat16 matrix instructions" in m]
    held = [m for m in said if "layers held for fbgemm" in m]
    fbgemm_layers = [m for m in loaded.model.modules() if type(m) is Bf16FbgemmLinear]
    if units or switch == "0":
        assert not held and not fbgemm_layers
        assert len(warned) == (0 if units else 1)
    else:
        assert not warned and len(held) == 1
        assert fbgemm_layers and not any(type(m) is torch.nn.Linear for m in loaded.model.modules())
        assert f"{len(fbgemm_layers)} bfloat16 linear layers held for fbgemm" in held[0]
        assert " 0 of " in held[0]  # a random-init checkpoint's weights all fit


@needs_proc_maps
def test_embedding_rows_are_read_from_a_file_only_while_it_is_the_one_mapped(tmp_path):
    """``FileRows`` reads a table's rows from the file its mapping came from; once that path
    names another file (a checkpoint renamed over it), none is built and the mapping is read."""
    import mmap

    from common.fp16_weights import FileRows
    from common.memory import file_location

    table = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16).to(torch.bfloat16)
    path = tmp_path / "t.safetensors"
    path.write_bytes(b"\0" * 4096 + table.view(torch.uint8).numpy().tobytes())
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    view = torch.frombuffer(mapped, dtype=torch.uint8)[4096:].view(torch.bfloat16).reshape(64, 16)
    assert file_location(view) == (str(path), 4096, path.stat().st_ino)
    rows = FileRows.for_table(view)
    ids = torch.tensor([[63, 0, 17], [17, 5, 40]])
    assert torch.equal(rows.lookup(ids), table[ids].float())
    assert rows.lookup(torch.empty(2, 0, dtype=torch.long)).shape == (2, 0, 16)
    twin = copy.deepcopy(rows)  # a descriptor of its own
    assert twin.fd != rows.fd and torch.equal(twin.lookup(ids), table[ids].float())
    del rows
    gc.collect()
    assert torch.equal(twin.lookup(ids), table[ids].float())
    assert file_location(torch.zeros(8)) is None  # not a file mapping
    (tmp_path / "new.safetensors").write_bytes(path.read_bytes())
    os.replace(tmp_path / "new.safetensors", path)
    assert file_location(view) is None and FileRows.for_table(view) is None
    with pytest.raises(ValueError):
        copy.deepcopy(twin)  # its path names another file now
    del view, twin
    mapped.close()


def test_zero_threads_means_one_per_core_this_process_may_run_on(monkeypatch):
    from common import models

    monkeypatch.setattr(models.os, "sched_getaffinity", lambda pid: {3, 5, 7}, raising=False)
    previous = torch.get_num_threads()
    try:
        models.set_torch_threads(0)
        assert torch.get_num_threads() == 3
        models.set_torch_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(previous)

