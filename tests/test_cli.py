"""The CLI: help without heavy imports, generate end to end on the tiny model, clear errors."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from specrt.cli import main


def test_import_and_help_do_not_load_heavy_modules():
    code = (
        "import sys, importlib, pkgutil, specrt\n"
        "from click.testing import CliRunner\n"
        "from specrt.cli import main\n"
        "for cmd in [[], ['convert'], ['export'], ['build-engines'], ['generate'], ['serve'], ['inspect'], "
        "['bench']]:\n"
        "    r = CliRunner().invoke(main, cmd + ['--help'])\n"
        "    assert r.exit_code == 0, (cmd, r.output)\n"
        "for m in pkgutil.walk_packages(specrt.__path__, 'specrt.'):\n"
        "    importlib.import_module(m.name)\n"
        "heavy = [m for m in ('torch', 'onnxruntime', 'onnx', 'tensorrt', 'tensorrt_rtx', 'transformers', 'fastapi', "
        "'uvicorn') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    # every module imports; importing them pulls in torch (the model definition) but never a
    # GPU library or transformers; help alone pulls in nothing heavy (checked below)
    assert "tensorrt" not in out and "transformers" not in out and "fastapi" not in out
    heavy = "('torch', 'onnxruntime', 'onnx')"
    code_help = f"import sys\nfrom specrt.cli import main\nprint([m for m in {heavy} if m in sys.modules])"
    assert (
        subprocess.run([sys.executable, "-c", code_help], capture_output=True, text=True, check=True).stdout.strip()
        == "[]"
    )


def test_generate_streams_and_reports(tiny_artifacts):
    r = CliRunner().invoke(
        main, ["generate", "--artifacts", str(tiny_artifacts), "--prompt", "w5 w6", "--max-new-tokens", "8"]
    )
    assert r.exit_code == 0, r.output
    assert "generated 8" in r.output or "(stop)" in r.output
    assert "tokens/s" in r.output and "CPUExecutionProvider" in r.output


def test_generate_sampling_options(tiny_artifacts):
    args = [
        "generate",
        "--artifacts",
        str(tiny_artifacts),
        "w5",
        "--temperature",
        "0.7",
        "--top-k",
        "20",
        "--top-p",
        "0.9",
        "--seed",
        "4",
        "--max-new-tokens",
        "6",
        "--no-chat",
    ]
    a = CliRunner().invoke(main, args)
    b = CliRunner().invoke(main, args)
    assert a.exit_code == 0, a.output
    assert a.output.splitlines()[0] == b.output.splitlines()[0]


def test_generate_with_wrong_checkpoint_is_refused(tiny_artifacts, tmp_path):
    from conftest import random_model, save_checkpoint, tiny_hf_config

    other = save_checkpoint(random_model(tiny_hf_config(), seed=11), tiny_hf_config(), tmp_path / "other")
    r = CliRunner().invoke(
        main, ["generate", "--artifacts", str(tiny_artifacts), "--model", str(other), "--prompt", "w5"]
    )
    assert r.exit_code == 1 and "Error: engine" in r.output and "Rebuild it" in r.output


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["generate", "--artifacts", "/nonexistent", "--prompt", "hi"],
            "does not exist. Create it with: specrt build-engines",
        ),
        (["generate", "--prompt", "hi"], "give --artifacts DIR"),
        (["bench", "--methods", "suffix,eagle3"], "eagle3: choose among ngram, suffix, auto, lookahead"),
        (["bench", "--split", "--artifacts", "/nonexistent"], "--split runs two ORT engines of --artifacts"),
        (["export", "--model", "/nonexistent", "--out", "/tmp/x"], "checkpoint directory /nonexistent does not exist"),
        (
            ["export", "--model", "/nonexistent", "--out", "/tmp/x", "--hidden-layers", "a,b"],
            "comma-separated layer indices",
        ),
    ],
)
def test_cli_errors_are_one_clear_line(args, message):
    r = CliRunner().invoke(main, args)
    assert r.exit_code != 0
    assert message in r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--temperature", "nan", "Invalid value for '--temperature': 'nan' is not a finite number"),
        ("--temperature", "inf", "Invalid value for '--temperature': 'inf' is not a finite number"),
        ("--temperature", "-0.5", "Invalid value for '--temperature': -0.5 is not in [0.0, inf)"),
        ("--top-p", "nan", "Invalid value for '--top-p': 'nan' is not a finite number"),
        ("--top-p", "0", "Invalid value for '--top-p': 0.0 is not in (0.0, 1.0]"),
        ("--seed", "-1", "Invalid value for '--seed': -1 is not in the range x>=0"),
    ],
)
def test_out_of_range_sampling_options_are_refused(tiny_artifacts, option, value, message):
    """NaN passed click's FloatRange and generated empty text with exit 0; a negative seed was a
    numpy traceback."""
    r = CliRunner().invoke(main, ["generate", "--artifacts", str(tiny_artifacts), "--prompt", "w5", option, value])
    assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output


def test_sampling_params_refuse_nan_and_negative_seeds():
    from specrt.errors import SpecrtError
    from specrt.runtime.sampling import SamplingParams

    for kw, message in [
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"top_p": float("nan")}, "top_p must be a finite number"),
        ({"temperature": float("inf")}, "temperature must be a finite number"),
        ({"seed": -3}, "seed must be an integer >= 0"),
    ]:
        with pytest.raises(SpecrtError, match=message):
            SamplingParams(**kw)


def test_generate_empty_and_too_long_prompt(tiny_artifacts):
    r = CliRunner().invoke(main, ["generate", "--artifacts", str(tiny_artifacts), "--prompt", ""])
    assert r.exit_code == 1 and "prompt is empty" in r.output
    long_prompt = " ".join(["w7"] * 300)  # tiny model context is 256
    r = CliRunner().invoke(main, ["generate", "--artifacts", str(tiny_artifacts), "--prompt", long_prompt, "--no-chat"])
    assert r.exit_code == 1 and "has 300 tokens" in r.output and "shorten the prompt" in r.output


def test_generate_torch_backend_matches_engine(tiny_checkpoint, tiny_artifacts):
    a = CliRunner().invoke(
        main,
        [
            "generate",
            "--backend",
            "torch",
            "--model",
            str(tiny_checkpoint),
            "--prompt",
            "w9 w10",
            "--max-new-tokens",
            "10",
        ],
    )
    b = CliRunner().invoke(
        main, ["generate", "--artifacts", str(tiny_artifacts), "--prompt", "w9 w10", "--max-new-tokens", "10"]
    )
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output
    assert a.output.splitlines()[0] == b.output.splitlines()[0]
    assert "torch" in a.output


def test_generate_with_draft_prints_metrics(tiny_artifacts):
    args = [
        "generate",
        "--artifacts",
        str(tiny_artifacts),
        "--prompt",
        "w5 w6 w5 w6 w5",
        "--no-chat",
        "--max-new-tokens",
        "12",
    ]
    plain = CliRunner().invoke(main, args)
    for draft, n in (("ngram", "3"), ("suffix", "auto")):
        r = CliRunner().invoke(main, args + ["--draft", draft, "--num-draft", n])
        assert r.exit_code == 0, r.output
        assert r.output.splitlines()[0] == plain.output.splitlines()[0]
        assert f"[{draft} draft, num_draft={n}]" in r.output and "mean accepted length" in r.output
    r = CliRunner().invoke(main, args + ["--draft", "ngram", "--num-draft", "lots"])
    assert r.exit_code == 1 and "num_draft must be a number" in r.output


def test_generate_cuda_options_without_gpu(tiny_checkpoint):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present; the refusal cannot be shown")
    base = ["generate", "--backend", "torch", "--model", str(tiny_checkpoint), "--prompt", "w5"]
    r = CliRunner().invoke(main, base + ["--device", "cuda"])
    assert r.exit_code == 1 and "torch sees no CUDA GPU" in r.output
    r = CliRunner().invoke(main, base + ["--cuda-graphs"])
    assert r.exit_code == 1 and "CUDA graphs need a CUDA device" in r.output


def test_generate_trt_backend_without_gpu(tiny_artifacts, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present; the refusal cannot be shown")
    pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx is not installed (make setup installs it)")
    r = CliRunner().invoke(main, ["generate", "--backend", "trt", "--artifacts", str(tiny_artifacts), "--prompt", "w5"])
    assert r.exit_code == 1 and "trt-tensorrt-rtx needs an NVIDIA GPU" in r.output and "--backend ort" in r.output
    r = CliRunner().invoke(main, ["generate", "--backend", "trt", "--artifacts", str(tmp_path), "--prompt", "w5"])
    assert r.exit_code == 1 and "has no TensorRT engine" in r.output and "build-engines" in r.output


def test_inspect_artifacts(tiny_artifacts, tmp_path):
    import json
    import shutil

    import torch

    r = CliRunner().invoke(main, ["inspect", str(tiny_artifacts)])
    out = r.output
    assert "[onnx-step-graph]" in out and "[ort-engine]" in out and "status      usable here" in out
    assert "LlamaForCausalLM: 2 layers, hidden 64, vocab 128" in out
    if (tiny_artifacts / "engines" / "trt-tensorrt-rtx").is_dir():
        assert "[trt-engine]" in out and "verify         1..1       1..17       0..2112" in out and "prefill" in out
        if not torch.cuda.is_available():
            assert "running it needs an NVIDIA GPU and there is none here" in out and r.exit_code == 1
    art = shutil.copytree(tiny_artifacts, tmp_path / "art")
    m = json.loads((art / "engines" / "ort-cpu" / "manifest.json").read_text())
    m["versions"]["onnxruntime"] = "1.0.0"
    (art / "engines" / "ort-cpu" / "manifest.json").write_text(json.dumps(m))
    r = CliRunner().invoke(main, ["inspect", str(art / "engines" / "ort-cpu")])
    assert r.exit_code == 1 and "refused here: engine" in r.output and "was built with onnxruntime 1.0.0" in r.output
    r = CliRunner().invoke(main, ["inspect", str(tmp_path)])
    assert r.exit_code == 1 and "holds no specrt artifacts" in r.output


def test_inspect_says_what_every_engine_computes(tiny_artifacts, tmp_path):
    """A precision line for graphs and engines of every kind: the scheme, the weights' bits and
    the activations' type (int8-a8 and gguf-a8 said neither); an engine built before its
    manifest recorded it reads its ONNX export's, and says so when that is gone."""
    import json
    import shutil

    from specrt.inspection import precision_line

    r = CliRunner().invoke(main, ["inspect", str(tiny_artifacts)])
    floats = [line for line in r.output.splitlines() if line.startswith("  precision")]
    assert len(floats) == len(list(tiny_artifacts.glob("onnx*/manifest.json"))) + len(
        list(tiny_artifacts.glob("engines/*/manifest.json"))
    )
    assert set(floats) == {"  precision   float32: 32-bit float weights, float32 activations"}
    level4 = "int8 activations (MatMulNBits at accuracy level 4"
    table = [
        ({"scheme": "int8-a8", "bits": 8, "block_size": 32, "accuracy_level": 4},
         f"int8-a8: 8-bit weights in blocks of 32, {level4}"),
        ({"scheme": "gguf-a8", "bits": 4, "accuracy_level": 4, "rewritten_matmuls": {"Q4_K": 7, "Q6_K": 1}},
         f"gguf-a8: 4-bit and 6-bit weights (7 Q4_K, 1 Q6_K MatMuls), {level4}"),
        ({"scheme": "gguf", "bits": 4, "accuracy_level": 0, "rewritten_matmuls": {"Q4_1": 3}},
         "gguf: 4-bit weights (3 Q4_1 MatMuls), float32 activations"),
        ({"scheme": "hqq", "bits": 4, "accuracy_level": 0, "rewritten_matmuls": {"Q4_1": 14, "Q8_0": 1}},
         "hqq: 4-bit and 8-bit weights (14 Q4_1, 1 Q8_0 MatMuls), float32 activations"),
        ({"scheme": "qdq-fp8", "bits": 8},
         "qdq-fp8: 8-bit float (FP8 E4M3) weights per output channel, FP8 activations"),
        ({"scheme": "bf16", "compute_dtype": "bfloat16"},
         "bf16: 16-bit float (bfloat16) weights, bfloat16 activations"),
    ]  # fmt: skip
    for q, said in table:
        assert precision_line(q).startswith(said), precision_line(q)
    art = shutil.copytree(tiny_artifacts, tmp_path / "art")
    path = art / "engines" / "ort-cpu" / "manifest.json"
    m = json.loads(path.read_text())
    assert "quantization" in m  # recorded at build
    del m["quantization"]
    m["onnx"]["path"] = str(art / "onnx-fused")
    path.write_text(json.dumps(m))
    r = CliRunner().invoke(main, ["inspect", str(art / "engines" / "ort-cpu")])
    assert "precision   float32: 32-bit float weights, float32 activations" in r.output, r.output
    shutil.rmtree(art / "onnx-fused")
    r = CliRunner().invoke(main, ["inspect", str(art / "engines" / "ort-cpu")])
    assert "precision   not recorded" in r.output and "it computes as float32: rebuild it" in r.output, r.output


def test_generate_with_quantized_engine(tiny_checkpoint, tmp_path):
    art = tmp_path / "art"
    r = CliRunner().invoke(
        main,
        [
            "build-engines",
            "--model",
            str(tiny_checkpoint),
            "--out",
            str(art),
            "--tensorrt",
            "off",
            "--quantize",
            "int4",
        ],
    )
    assert r.exit_code == 0 and "onnx-fused-int4: quantized" in r.output, r.output
    r = CliRunner().invoke(
        main, ["generate", "--artifacts", str(art), "--quantize", "int4", "--prompt", "w5 w6", "--max-new-tokens", "6"]
    )
    assert r.exit_code == 0 and "generated 6" in r.output, r.output
    r = CliRunner().invoke(main, ["generate", "--artifacts", str(art), "--quantize", "int8-a8", "--prompt", "w5"])
    assert r.exit_code == 1 and "ort-cpu-int8-a8 does not exist" in r.output and "--quantize int8-a8" in r.output
    r = CliRunner().invoke(main, ["inspect", str(art)])
    assert "quantized   int4: 4-bit weights in blocks of 32, float32 activations" in r.output
    engine = r.output[r.output.index("engines/ort-cpu-int4  [ort-engine]") :]
    assert "precision   int4: 4-bit weights in blocks of 32, float32 activations" in engine, r.output


def test_build_and_generate_with_the_gguf_engine(tmp_path):
    """--quantize gguf finds the GGUF through --gguf (a checkpoint converted before specrt
    recorded its origin), and generate runs the engine; inspect says what it computes."""
    from specrt.export.checkpoint import load_model

    from conftest import random_model, save_checkpoint, tiny_hf_config
    from test_gguf_blocks import TYPES
    from tiny_gguf import write_gguf

    hf = tiny_hf_config()
    write_gguf(random_model(hf, seed=3), hf, tmp_path / "m.gguf", TYPES)
    ckpt = save_checkpoint(load_model(tmp_path / "m.gguf"), hf, tmp_path / "ckpt")
    art = tmp_path / "art"
    args = ["build-engines", "--model", str(ckpt), "--out", str(art), "--tensorrt", "off", "--quantize", "gguf"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 1 and "records no GGUF file" in r.output and "--gguf FILE" in r.output, r.output
    r = CliRunner().invoke(main, [*args, "--gguf", str(tmp_path / "m.gguf")])
    assert r.exit_code == 0 and "onnx-fused-gguf: quantized" in r.output, r.output
    r = CliRunner().invoke(
        main, ["generate", "--artifacts", str(art), "--quantize", "gguf", "--prompt", "w5 w6", "--max-new-tokens", "6"]
    )
    assert r.exit_code == 0 and "generated 6" in r.output, r.output
    gen = ["generate", "--artifacts", str(art), "--prompt", "w5 w6", "--max-new-tokens", "6", "--split"]
    r = CliRunner().invoke(main, gen)
    assert r.exit_code == 2 and "--split runs two ORT engines" in r.output, r.output
    r = CliRunner().invoke(main, [*gen, "--quantize", "gguf", "--draft", "ngram"])
    assert r.exit_code == 0 and "generated 6" in r.output, r.output
    r = CliRunner().invoke(main, ["inspect", str(art)])
    assert "quantized   gguf: the GGUF's own blocks (m.gguf): 4 Q4_0, 8 Q4_1, 3 Q8_0 MatMuls" in r.output, r.output


def test_calibrate_then_build_and_generate_with_the_fitted_recipes(tiny_checkpoint, tmp_path):
    """specrt calibrate makes the set from the target's answers; build-engines --quantize gptq
    uses it (and makes it when missing), hqq needs none; generate runs both; inspect says what
    each was fitted to."""
    art = tmp_path / "art"
    build = ["build-engines", "--model", str(tiny_checkpoint), "--out", str(art), "--tensorrt", "off"]
    r = CliRunner().invoke(main, ["calibrate", "--model", str(tiny_checkpoint), "--artifacts", str(art)])
    assert r.exit_code == 2 and "no float ORT engine" in r.output, r.output
    r = CliRunner().invoke(main, [*build, "--quantize", "gptq"])
    assert r.exit_code == 0 and "calibration" in r.output and "onnx-gptq: quantized" in r.output, r.output
    cal = art / "calibration" / "set.json"
    assert cal.is_file()
    r = CliRunner().invoke(main, ["calibrate", "--model", str(tiny_checkpoint), "--artifacts", str(art)])
    assert r.exit_code == 0 and "32 sequences" in r.output, r.output
    r = CliRunner().invoke(main, [*build, "--quantize", "hqq"])
    assert r.exit_code == 0 and "onnx-hqq: quantized" in r.output, r.output
    for scheme in ("gptq", "hqq"):
        args = ["generate", "--artifacts", str(art), "--quantize", scheme, "--prompt", "w5 w6", "--max-new-tokens", "6"]
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 0 and "generated 6" in r.output, r.output
    r = CliRunner().invoke(main, ["inspect", str(art)])
    assert "quantized   gptq: 14 Q4_1, 1 Q8_0 MatMuls (1 kept in 8-bit), fitted to 32 calibration sequences" in r.output
    assert "quantized   hqq: 14 Q4_1, 1 Q8_0 MatMuls (1 kept in 8-bit), fitted without data" in r.output, r.output
    r = CliRunner().invoke(main, [*build, "--quantize", "gptq", "--calibration", str(tmp_path / "none.json")])
    assert r.exit_code == 1 and "no calibration set" in r.output, r.output


def test_calibrate_report_compares_each_built_engine_with_float(tiny_checkpoint, tmp_path):
    import json

    art, out = tmp_path / "art", tmp_path / "report"
    build = ["build-engines", "--model", str(tiny_checkpoint), "--out", str(art), "--tensorrt", "off"]
    for scheme in ("hqq", "int4"):
        assert CliRunner().invoke(main, [*build, "--quantize", scheme]).exit_code == 0
    args = ["calibrate", "--model", str(tiny_checkpoint), "--artifacts", str(art), "--prompts", "4", "--report"]
    r = CliRunner().invoke(main, [*args, "--schemes", "hqq,int5"])
    assert r.exit_code == 2 and "int5: choose from" in r.output, r.output
    from test_eagle import make_head_dir

    r = CliRunner().invoke(main, [*args, "--heads", str(tmp_path)])
    assert r.exit_code == 1 and "not a built draft head" in r.output, r.output
    head = make_head_dir(tiny_checkpoint, "eagle3", tmp_path / "heads" / "eagle3", draft_vocab=64).root
    r = CliRunner().invoke(main, [*args, "--report-out", str(out), "--report-tokens", "8", "--heads", str(head)])
    assert r.exit_code == 0, r.output
    result = json.loads(next(out.glob("quant-report-*.json")).read_text())
    rows = result["engines"]
    assert list(rows) == ["float32", "hqq", "int4"]  # every built engine, none that is not
    assert rows["float32"]["top1_agreement"] == 1.0 and rows["float32"]["mean_kl"] == 0.0
    # the head runs on the engine it was trained against and is refused by the others
    assert rows["float32"]["drafts"]["eagle3 (eagle3)"]["equals_plain"] == "4/4"
    assert "precision" in rows["hqq"]["drafts"]["eagle3 (eagle3)"]["refused"]
    for name in ("hqq", "int4"):
        assert 0 < rows[name]["mean_kl"] and rows[name]["top1_agreement"] < 1.0
        assert rows[name]["batch_variance"] <= 1e-4 and rows[name]["drafts"]["suffix"]["equals_plain"].startswith("4/")
        assert set(rows[name]["step_ms"]) == {"1", "2", "4", "8", "16"}
    assert next(out.glob("quant-report-*.png")).stat().st_size > 0
    assert "hqq" in r.output and "suffix draft" in r.output


def test_qdq_schemes_build_for_tensorrt_and_run_on_ort(tiny_checkpoint, tmp_path):
    """qdq-int8 builds (calibration made on the way) and generates on ORT; TensorRT takes only the
    Q/DQ schemes, and a missing TensorRT engine names the command that builds it."""
    art = tmp_path / "art"
    build = ["build-engines", "--model", str(tiny_checkpoint), "--out", str(art), "--tensorrt", "off"]
    r = CliRunner().invoke(main, [*build, "--quantize", "qdq-int8"])
    assert r.exit_code == 0 and "onnx-qdq-int8: quantized" in r.output, r.output
    gen = ["generate", "--artifacts", str(art), "--prompt", "w5 w6", "--max-new-tokens", "6"]
    r = CliRunner().invoke(main, [*gen, "--quantize", "qdq-int8"])
    assert r.exit_code == 0 and "generated 6" in r.output, r.output
    r = CliRunner().invoke(main, ["inspect", str(art)])
    assert "quantized   qdq-int8: Q/DQ for TensorRT, 14 MatMuls (SmoothQuant alpha 0.8; 1 kept in float32)" in r.output
    r = CliRunner().invoke(main, [*gen, "--backend", "trt", "--quantize", "gguf"])
    assert r.exit_code == 2 and "TensorRT takes the Q/DQ and 16-bit schemes" in r.output, r.output
    r = CliRunner().invoke(main, [*gen, "--backend", "trt", "--quantize", "qdq-int8"])
    assert r.exit_code == 1 and "trt-tensorrt-rtx-qdq-int8" in r.output and "--quantize qdq-int8" in r.output


def test_error_during_a_progress_bar_gets_its_own_line(tiny_checkpoint, tmp_path):
    """The export's bar is drawn when the config turns out bad: the message must not land on the
    bar's line, and the bar must not be redrawn after it."""
    import json
    import shutil

    d = shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 0}))
    r = subprocess.run(
        [sys.executable, "-m", "specrt.cli", "export", "--model", str(d), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1
    lines = r.stderr.replace("\r", "\n").strip().splitlines()
    assert "export:" in r.stderr  # the bar was drawn
    assert lines[-1].startswith("Error: ") and "num_attention_heads must be a positive integer" in lines[-1]


def test_train_draft_then_generate_with_it(tiny_checkpoint, tiny_artifacts, tmp_path):
    """The whole command on a tiny model: data, training, export and engine; then generate and
    inspect use the head; the output equals plain greedy; a missing --draft-dir is a usage error."""
    out = tmp_path / "eagle3"
    args = ["train-draft", "--method", "eagle3", "--model", str(tiny_checkpoint), "--out", str(out)]
    args += ["--artifacts", str(tiny_artifacts), "--prompts", "12", "--max-new-tokens", "8", "--epochs", "1"]
    args += ["--draft-vocab", "64", "--tensorrt", "off", "--hold-out", str(tmp_path / "none.jsonl")]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert "eagle3 head in" in r.output and "held-out acceptance per draft step" in r.output
    assert (out / "engines" / "ort-cpu" / "manifest.json").is_file() and (out / "head" / "training.json").is_file()
    common = ["generate", "--artifacts", str(tiny_artifacts), "--prompt", "w5 w6 w7", "--max-new-tokens", "12"]
    plain = CliRunner().invoke(main, common)
    spec = CliRunner().invoke(main, [*common, "--draft", "eagle3", "--draft-dir", str(out), "--draft-tree", "2,3"])
    assert plain.exit_code == spec.exit_code == 0, spec.output
    assert spec.stdout.splitlines()[0] == plain.stdout.splitlines()[0]
    r = CliRunner().invoke(main, [*common, "--draft", "eagle3"])
    assert r.exit_code == 2 and "needs --draft-dir" in r.output
    r = CliRunner().invoke(main, [*common, "--draft", "eagle3", "--draft-dir", str(out), "--draft-tree", "x"])
    assert r.exit_code == 2 and "TOP_K,DEPTH" in r.output
    r = CliRunner().invoke(main, ["inspect", str(out)])
    assert "[onnx-draft-head]" in r.output and "[ort-draft-head]" in r.output and r.exit_code == 0


def test_serve_speculates_by_default_and_generate_does_not():
    """serve's --draft defaults to auto (plain decoding is --draft none), generate's to none."""
    defaults = {
        name: next(p.default for p in main.commands[name].params if p.name == "draft") for name in ("serve", "generate")
    }
    assert defaults["serve"] == "auto" and defaults["generate"] == "none"


@pytest.mark.real_model
def test_generate_structured_output(real_artifacts, tmp_path):
    """--json-schema FILE and --regex on the default model, with and without a draft; a bad
    schema, an unreadable file and both options at once are one-line errors."""
    base = ["generate", "--artifacts", str(real_artifacts), "--max-new-tokens", "60"]
    schema = tmp_path / "s.json"
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    schema.write_text(json.dumps(city | {"additionalProperties": False}))
    ask = ["--prompt", "Where is the Eiffel Tower? Answer as JSON."]
    plain = CliRunner().invoke(main, [*base, *ask, "--json-schema", str(schema)])
    assert plain.exit_code == 0, plain.output
    spec = CliRunner().invoke(main, [*base, *ask, "--json-schema", str(schema), "--draft", "suffix"])
    assert spec.exit_code == 0, spec.output
    assert plain.stdout.strip() == spec.stdout.strip(), (plain.output, spec.output)
    assert list(json.loads(plain.stdout.strip())) == ["city"], plain.output
    r = CliRunner().invoke(main, [*base, "--prompt", "Is the sky blue?", "--regex", "(yes|no)"])
    assert r.exit_code == 0 and r.stdout.strip() in ("yes", "no"), r.output
    schema.write_text('{"type": "objx"}')
    r = CliRunner().invoke(main, [*base, "--prompt", "x", "--json-schema", str(schema)])
    assert r.exit_code != 0 and "JSON schema cannot be compiled: Invalid type: objx" in r.output
    r = CliRunner().invoke(main, [*base, "--prompt", "x", "--json-schema", str(tmp_path / "none.json")])
    assert r.exit_code == 2 and "cannot read" in r.output
    r = CliRunner().invoke(main, [*base, "--prompt", "x", "--json-schema", str(schema), "--regex", "a"])
    assert r.exit_code == 2 and "not both" in r.output
