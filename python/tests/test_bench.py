"""python -m megamoe.bench: the GEMM/other split of kernel profiles, the picture (--plot, --plot-from) and the
command line on the CPU; on the GPU, a short real run with --json and --plot whose profile must find the
GEMM kernels of both implementations."""

import json
import subprocess
import sys

import pytest
import torch
from gpu_support import why_no_gpu

from megamoe import bench


def report(profiled=True):
    def row(config, h, i, base_ms, mine_ms):
        r = dict(config=config, hidden=h, intermediate=i, experts=16, top_k=8, tokens=16384, virtual_ranks=1,
                 flops=18.0 * h * i * 16384 * 8,
                 pytorch=dict(fwd_ms=base_ms / 3, bwd_ms=2 * base_ms / 3, total_ms=base_ms, fwd_tflops=1,
                              bwd_tflops=1, total_tflops=1),
                 megamoe=dict(fwd_ms=mine_ms / 3, bwd_ms=2 * mine_ms / 3, total_ms=mine_ms, fwd_tflops=1,
                              bwd_tflops=1, total_tflops=1),
                 speedup=dict(total=base_ms / mine_ms))
        if profiled:
            r["profile"] = {"pytorch": dict(gemm_ms=0.5 * base_ms, other_kernels_ms=0.3 * base_ms, total_ms=base_ms,
                                            rest_ms=0.5 * base_ms, gemm_tflops=500.0),
                            "megamoe": dict(gemm_ms=0.6 * mine_ms, other_kernels_ms=0.3 * mine_ms, total_ms=mine_ms,
                                            rest_ms=0.4 * mine_ms, gemm_tflops=600.0)}
            r["gemms_alone"] = dict(engine_tflops=600.0, ms=0.6 * mine_ms)
        return r

    return dict(device="test GPU", torch=torch.__version__, iters=3,
                rows=[row("qwen3-30b-a3b", 2048, 768, 15.9, 10.1), row("qwen3-235b-a22b", 4096, 1536, 40.9, 30.5)])


def test_kernel_split_counts_every_engines_gemm_kernels():
    kernels = [
        ("void megamoe::kernels::(anonymous namespace)::grouped_gemm_kernel<(Form)0, 1, 1, 2>(...)", 100.0),
        ("void megamoe::kernels::simple_grouped_gemm_kernel(Params)", 7.0),
        ("void megamoe::kernels::fp8_gemm_kernel<megamoe::kernels::Fp8GemmConfig<1, false, true, false>>(...)", 11.0),
        ("void megamoe::kernels::fp8_wgrad_kernel<megamoe::kernels::Fp8WgradConfig<false, 1, 192>>(...)", 9.0),
        ("void megamoe::kernels::token_major_quantize_kernel<megamoe::kernels::E4m3GatheringRows>(...)", 2.0),
        ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB", 50.0),
        ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x1_tn_align8>(...)", 20.0),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 3.0),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel...>", 30.0),
        ("void megamoe::kernels::combine_kernel<...>", 10.0),
        ("void megamoe::kernels::swiglu_permute_rows_kernel<...>", 4.0),
        ("Memcpy HtoD (Pageable -> Device)", 5.0),
    ]
    gemm_ms, other_ms = bench.kernel_split(kernels)
    assert gemm_ms == pytest.approx(0.200) and other_ms == pytest.approx(0.051)


def test_plot_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    bench.plot(report(), path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    with pytest.raises(ValueError, match="no profiled rows"):
        bench.plot(report(profiled=False), tmp_path / "empty.png")


def test_plot_from_a_saved_json_needs_no_gpu(tmp_path):
    pytest.importorskip("matplotlib")
    saved = tmp_path / "bench.json"
    saved.write_text(json.dumps(report()))
    png = tmp_path / "from_json.png"
    result = subprocess.run([sys.executable, "-m", "megamoe.bench", "--plot-from", str(saved), "--plot", str(png)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert png.read_bytes()[:4] == b"\x89PNG" and "plot written" in result.stderr


def test_plot_without_matplotlib_says_what_to_install(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(SystemExit) as info:
        bench.main(["--plot", str(tmp_path / "x.png")])
    assert info.value.code == 2
    assert "--plot needs matplotlib: pip install matplotlib" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--iters", "0"], "--iters must be at least 1, got 0"),
    (["--tokens", "-5"], "--tokens must be at least 1, got -5"),
    (["--warmup", "-1"], "--warmup must be at least 0"),
    (["--plot-from", "x.json"], "--plot-from needs --plot FILE.png"),
    (["--precision", "fp16"], "invalid choice: 'fp16'"),
])
def test_bad_arguments_are_refused(capsys, args, message):
    with pytest.raises(SystemExit) as info:
        bench.main(args)
    assert info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_without_a_gpu_it_says_so(capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(["--iters", "1"])
    assert info.value.code == 2 and "needs a CUDA device" in capsys.readouterr().err




@pytest.mark.skipif(bool(why_no_gpu()), reason=why_no_gpu() or "ok")
def test_short_gpu_run_with_json_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert bench.main(["--config", "qwen3-30b-a3b", "--tokens", "4096", "--warmup", "1", "--iters", "3",
                       "--profile-iters", "2", "--json", str(out), "--plot", str(png)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    for impl in ("pytorch", "megamoe"):
        prof = row["profile"][impl]
        assert prof["gemm_ms"] > 0, f"no GEMM kernel of {impl} found in the profile"
        assert prof["other_kernels_ms"] > 0 and prof["gemm_ms"] < prof["total_ms"] * 1.05
        assert 50 < prof["gemm_tflops"] < 2000
    assert row["gemms_alone"]["ms"] == pytest.approx(row["profile"]["megamoe"]["gemm_kernels_ms"], rel=1e-6)
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(bool(why_no_gpu()), reason=why_no_gpu() or "ok")
def test_short_fp8_gpu_run_reports_its_precision(tmp_path):
    out = tmp_path / "bench.json"
    assert bench.main(["--config", "qwen3-30b-a3b", "--tokens", "2048", "--warmup", "1", "--iters", "2",
                       "--precision", "fp8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert report["precision"] == "fp8" and row["precision"] == "fp8"
    assert row["megamoe"]["total_ms"] > 0 and row["pytorch"]["total_ms"] > 0
