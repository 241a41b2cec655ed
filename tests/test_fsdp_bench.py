"""The FSDP2 throughput comparison's pieces that need no GPU (issue 31): model FLOPs and MFU, the memory rule,
the scaling efficiency, variant selection and skip reasons, the torchrun wiring (torchrun faked), and (slow)
one 2-rank gloo run of the eager variant beside two skipped ones."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from kernelkit.testing import fsdp_bench as fb  # noqa: E402
from kernelkit.testing.model_bench import build_config  # noqa: E402

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "num_hidden_layers": 2, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": False}


def test_llama3_8b_parameters_flops_and_mfu():
    c = build_config("llama", None, 32, 2048)
    # per layer: q, o 4096^2 each; k, v 4096x1024 each; gate, up, down 4096x14336; two norms
    per_layer = 2 * 4096 ** 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert fb.non_embedding_params(c) == 32 * per_layer + 4096 + 128256 * 4096 == 7_504_924_672
    assert fb.total_params(c) == 8_030_261_248  # Llama-3-8B
    want = 6 * 7_504_924_672 + 12 * 32 * 2048 * 4096
    assert fb.flops_per_token(c, 2048) == want
    assert fb.mfu(1000.0, want, 989.4) == pytest.approx(1000 * want / 989.4e12)
    assert fb.mfu(1000.0, want, None) is None
    assert fb.peak_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.4


def test_memory_rule_says_which_world_sizes_fit_32_layers():
    c = build_config("llama", None, 32, 2048)
    assert "does not fit" in fb.too_big(c, "eager", 1, 79.1)          # 8 B/param: 59.8 GiB on one GPU
    assert fb.too_big(c, "kernelkit", 2, 79.1) is None                # 29.9 GiB per rank
    reason = fb.too_big(c, "torchtitan", 2, 79.1)                     # fp32 masters: 16 B/param, 59.8 GiB
    assert "16 bytes per parameter" in reason and "2 GPU(s)" in reason
    assert fb.too_big(c, "torchtitan", 4, 79.1) is None
    assert fb.too_big(build_config("llama", None, 8, 2048), "eager", 1, 79.1) is None  # the scaling config


def _row(variant, world, tps, layers=8):
    return {"variant": variant, "layers": layers, "seq": 2048, "batch_per_gpu": 1, "world_size": world,
            "tokens_per_s_per_gpu": tps}


def test_scaling_efficiency_against_the_fewest_gpus_of_the_same_config():
    rows = [_row("eager", 4, 900.0), _row("eager", 1, 1000.0), _row("eager", 2, 950.0),
            _row("eager", 4, 400.0, layers=32), _row("kernelkit", 4, 500.0, layers=32),
            _row("kernelkit", 2, 520.0, layers=32), {"variant": "liger", "world_size": 4, "skipped": "no liger"}]
    fb.add_scaling(rows)
    by = {(r["variant"], r["layers"], r["world_size"]): r for r in rows if "skipped" not in r}
    assert by["eager", 8, 4]["scaling_efficiency"] == 0.9 and by["eager", 8, 4]["scaling_base_gpus"] == 1
    assert by["eager", 8, 1]["scaling_efficiency"] == 1.0
    assert by["eager", 8, 4]["tokens_per_s_total"] == 3600.0
    assert by["eager", 32, 4]["scaling_efficiency"] is None  # no smaller world ran it
    assert by["kernelkit", 32, 4]["scaling_efficiency"] == round(500 / 520, 3)
    assert by["kernelkit", 32, 4]["scaling_base_gpus"] == 2
    assert "scaling_efficiency" not in rows[-1]


def test_variant_selection_and_skip_reasons(monkeypatch):
    assert fb.parse_variants(None) == fb.parse_variants("all") == fb.VARIANTS
    assert fb.parse_variants("torchtitan, eager,eager") == ("torchtitan", "eager")
    with pytest.raises(ValueError, match=r"unknown variant\(s\) \['fp4'\]"):
        fb.parse_variants("eager,fp4")
    assert set(fb.HF_VARIANT) | {"torchtitan"} == set(fb.VARIANTS)
    monkeypatch.setitem(sys.modules, "torchtitan", None)  # as on CI: not installed
    monkeypatch.delitem(sys.modules, "torchtitan.models.llama3", raising=False)
    assert "torchtitan's llama3 does not import" in fb.torchtitan_unavailable()


def test_meta_to_hf_names_and_rope_layout():
    c = _tiny_config()
    name = fb._meta_to_hf(c)
    assert name("tok_embeddings.weight") == ("model.embed_tokens.weight", None)
    assert name("layers.1.feed_forward.w2.weight")[0] == "model.layers.1.mlp.down_proj.weight"
    assert name("layers.0.ffn_norm.weight")[0] == "model.layers.0.post_attention_layernorm.weight"
    hf, unpermute = name("layers.0.attention.wk.weight")
    assert hf == "model.layers.0.self_attn.k_proj.weight"
    # Hugging Face's conversion from Meta's layout, per head: rows (pairs interleaved) -> (first halves, second)
    meta = torch.arange(2 * 16 * 3, dtype=torch.float).view(2 * 16, 3)
    hf_w = meta.view(2, 8, 2, 3).transpose(1, 2).reshape(32, 3)
    assert torch.equal(unpermute(hf_w), meta)


def _tiny_config():
    import transformers

    doc = dict(TINY)
    return transformers.AutoConfig.for_model(doc.pop("model_type"), **doc)


def test_nproc_runs_torchrun_per_world_and_layer_count(monkeypatch, tmp_path):
    """`bench model --nproc N` (torchrun faked): N GPUs at `layers`; with `scale_layers`, 1 and N GPUs at that
    count too; the rows gain tokens/s in total and the efficiency against one GPU."""
    calls = []

    def fake_run(cmd, **kw):
        n = int(next(a for a in cmd if a.startswith("--nproc_per_node=")).split("=")[1])
        layers = int(cmd[cmd.index("--layers") + 1])
        calls.append((n, layers, cmd[cmd.index("--variants") + 1]))
        assert cmd[cmd.index("-m", 3) + 1] == "kernelkit.testing.fsdp_bench"
        rows = [_row(v, n, tps / (1.25 if n > 1 else 1.0), layers) for v, tps in (("eager", 1000.0),
                                                                                  ("kernelkit", 1200.0))]
        with open(cmd[cmd.index("--out") + 1], "w") as f:
            json.dump({"environment": {"gpu": "fake"}, "rows": rows}, f)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(subprocess, "run", fake_run)
    doc = fb.run_nproc(4, layers=32, out=tmp_path, variants="eager,kernelkit", scale_layers=8)
    assert calls == [(4, 32, "eager,kernelkit"), (1, 8, "eager,kernelkit"), (4, 8, "eager,kernelkit")]
    four8 = [r for r in doc["rows"] if r["world_size"] == 4 and r["layers"] == 8]
    assert {r["scaling_efficiency"] for r in four8} == {0.8}
    assert [r["scaling_efficiency"] for r in doc["rows"] if r["layers"] == 32] == [None, None]
    assert (tmp_path / "model-nproc.json").exists()
    calls.clear()
    fb.run_nproc(2, layers=2)
    assert [c[:2] for c in calls] == [(2, 2), (1, 2)]
    with pytest.raises(ValueError, match="has 4 CUDA GPU"):
        fb.run_nproc(8)
    with pytest.raises(ValueError, match="unknown variant"):
        fb.run_nproc(2, variants="eager,nope")


def _gloo_rank(rank, world):
    """eager on 2 gloo ranks, liger and torchtitan made unimportable: two rows skipped with their reason; the
    sharded weights are the named draws."""
    for pkg in ("liger_kernel", "liger_kernel.transformers", "torchtitan"):
        sys.modules[pkg] = None
    config = _tiny_config()
    mesh = fb.device_mesh("cpu")
    model, _, _ = fb._hf_model(config, "eager", mesh, torch.device("cpu"), 0)
    emb = model.model.embed_tokens.weight
    drawn = fb._draw("model.embed_tokens.weight", tuple(emb.shape), 0, "cpu").to(torch.bfloat16)
    same = torch.equal(emb.full_tensor(), drawn) and emb.to_local().shape[0] == emb.shape[0] // world
    return same, [fb.bench_variant(v, config, 1, 16, steps=2, warmup=1) for v in ("eager", "liger", "torchtitan")]


# ~25 s here (two spawned processes import torch and transformers): `make test-all` runs it (CI time)
@pytest.mark.slow
def test_two_gloo_ranks_run_eager_and_skip_what_does_not_import():
    from kernelkit.testing.distributed import spawn

    (same0, rows), (same1, _) = spawn(_gloo_rank, 2)
    assert same0 and same1
    eager, liger, titan = rows
    assert eager["world_size"] == 2 and eager["tokens_per_s_per_gpu"] > 0 and len(eager["step_ms_rank0"]) == 2
    assert 5.0 < eager["first_loss"] < 6.0  # ln(256) = 5.55 for near-uniform logits
    assert liger["skipped"].startswith("Liger-Kernel is not installed") and "step_ms" not in liger
    assert titan["skipped"].startswith("torchtitan's llama3 does not import")
