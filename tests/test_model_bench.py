"""The model benchmark's pieces that need no GPU: configs, the table, the plot."""

import json
import sys

import pytest

pytest.importorskip("transformers")

from kernelkit.testing import model_bench as mb  # noqa: E402


def test_build_config_from_example_and_file(tmp_path):
    c = mb.build_config("llama", None, 3, 4096)
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.vocab_size) == ("llama", 3, 4096, 128256)
    assert c.max_position_embeddings >= 4096
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
                                "num_hidden_layers": 5}))
    c = mb.build_config(None, str(path), None, 128)
    assert (c.model_type, c.num_hidden_layers, c.hidden_size) == ("qwen2", 5, 64)


def test_table_and_plot_from_rows(tmp_path):
    from rich.console import Console

    rows = [{"variant": "eager", "step_ms": 100.0, "prefill_ms": 30.0, "peak_gib": 17.9, "loss": 12.1,
             "train_tokens_per_s": 81920.0, "prefill_tokens_per_s": 2.7e5, "x_eager_train": 1.0},
            {"variant": "kernelkit", "step_ms": 70.0, "prefill_ms": 25.0, "peak_gib": 6.0, "loss": 12.1001,
             "train_tokens_per_s": 117028.0, "prefill_tokens_per_s": 3.2e5, "x_eager_train": 1.43,
             "loss_rel_diff": 8e-6, "grad_worst": {"param": "model.norm.weight", "rel_err": 3e-3}},
            {"variant": "liger", "skipped": "Liger-Kernel is not installed"}]
    console = Console(record=True, width=200)
    mb.print_rows(rows, console)
    text = console.export_text()
    assert "model.norm.weight" in text and "not installed" in text and "1.43" in text
    mb.plot_rows(rows, tmp_path / "m.png", {"example": "llama", "layers": 2, "batch": 4, "seq": 2048})
    assert (tmp_path / "m.png").stat().st_size > 1000


def test_torchao_variants_are_known_and_follow_kernelkit_fp8():
    assert {"torchao-fp8", "torchao-fp8+compile"} <= set(mb.VARIANTS)
    got = mb.fp8_variants(("eager", "kernelkit+compile"))
    assert got == ("eager", "kernelkit+compile", "kernelkit-fp8+compile", "torchao-fp8+compile")


def test_torchao_variant_without_torchao_is_a_skipped_row_naming_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao...` now raises ImportError, as on CPU CI
    for variant in ("torchao-fp8", "torchao-fp8+compile"):
        path = tmp_path / f"{variant}.json"
        mb.main(["--variant", variant, "--example", "llama", "--layers", "1", "--seq", "64", "--json", str(path)])
        row = json.loads(path.read_text())
        assert row["variant"] == variant and "step_ms" not in row
        assert row["skipped"].startswith("torchao is not installed")


def test_torchao_filter_picks_the_linears_kernelkit_fp8_runs_in_fp8():
    import torch

    from kernelkit.patch import patch
    from tests.test_patch import tiny_model

    model = tiny_model("llama", dtype=torch.bfloat16, layers=2)
    keep = mb.torchao_fp8_filter(model)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    picked = {n for n, m in linears if keep(m, n)}
    assert "lm_head" in dict(linears) and "lm_head" not in picked
    assert picked == {f"model.layers.{i}.{p}" for i in range(2) for p in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")}
    # the same set kernelkit's fp8 patch rebinds (each one gets an instance forward)
    patch(model, rms_norm=False, mlp=False, rope=False, attention=False, cross_entropy=False, moe=False,
          precision="fp8")
    assert picked == {n for n, m in linears if "forward" in vars(m)}


def test_kernel_families_name_the_step_s_kernels_and_print():
    from rich.console import Console

    fam = mb.kernel_family
    assert fam("scaled_matmul_kernel") == "fp8 GEMM (kernelkit)"
    assert fam("quantize_cols_t_chunk_kernel") == "fp8 quantization"
    assert fam("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3") == "attention"
    assert fam("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTT") == "GEMM (cuBLAS / CUTLASS)"
    assert fam("rms_norm_fwd_kernel") == fam("triton_red_fused_add_0") == "Triton (kernelkit, torch.compile)"
    assert fam("void at::native::vectorized_elementwise_kernel<4, ...>") == "elementwise / reduce (torch)"
    assert fam("ncclDevKernel_AllGather_RING_LL") == "other"
    row = {"variant": "kernelkit-fp8", "skipped": "x", "kernels": {
        "busy_ms": 70.5, "profiled_wall_ms": 80.0, "kernels_per_step": 312,
        "families_ms": {"fp8 GEMM (kernelkit)": 20.0, "attention": 5.25}, "top": []}}
    console = Console(record=True, width=300)
    mb.print_rows([row], console)
    text = console.export_text()
    assert "GPU busy 70.5 of 80.0 ms" in text and "312 kernels" in text and "attention 5.2" in text
