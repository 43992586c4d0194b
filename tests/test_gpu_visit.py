"""The first GPU steps rehearsed on CPU (scripts/gpu/random_model.py, scripts/gpu/visit.py): ``random:<shape>``
models with their generated full-vocabulary tokenizer load with the network off, every id decodes, the data's
targets fill the response, and the visit script runs end to end on the CPU backend (its smoke step is the
CPU smoke test: 2 LUFFY steps, a validation, a checkpoint and a resume)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import sys
import tarfile
from pathlib import Path

import pytest

from e2e import cpu_env, read_metrics, run_command, tail

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def network_off(monkeypatch):
    """No connection leaves this process; HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE restored after the test."""
    def refuse(*args, **kwargs):
        raise OSError("network off in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny_random(tmp_path_factory) -> dict:
    import os

    from scripts.gpu import random_model as rm

    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    try:
        return rm.build("random:tiny", str(tmp_path_factory.mktemp("random_tiny")), response_length=32)
    finally:  # build() sets them for its process: leave the suite's environment as it was
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def test_random_tiny_loads_offline_and_every_id_decodes(tiny_random, network_off):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from scripts.gpu.random_model import N_BPE, SPECIALS, VOCAB_SIZE

    tok = AutoTokenizer.from_pretrained(tiny_random["tokenizer"])
    model = AutoModelForCausalLM.from_pretrained(tiny_random["model"])
    assert type(tok).__name__ == "Qwen2Tokenizer" and len(tok) == VOCAB_SIZE == model.config.vocab_size == 151936
    assert tok.convert_tokens_to_ids(SPECIALS) == [N_BPE, N_BPE + 1, N_BPE + 2] == [151643, 151644, 151645]
    assert (tok.eos_token_id, tok.pad_token_id) == (model.config.eos_token_id, model.config.pad_token_id)
    texts = [tok.decode([i]) for i in range(VOCAB_SIZE)]  # every id the model can sample
    assert all(texts) and len(set(tok.convert_ids_to_tokens(list(range(VOCAB_SIZE))))) == VOCAB_SIZE
    text = "Solve 12*(3+4)=?\n\n<think>x</think> \\boxed{84} héllo"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "1+2=?"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\n1+2=?<|im_end|>\n<|im_start|>assistant\n"
    assert AutoConfig.from_pretrained(tiny_random["model"]).tie_word_embeddings


def test_full_length_targets_fill_the_response(tiny_random):
    """Prefix rows (target + EOS, ratio 1.0) are exactly data.max_response_length long, and every prompt is the
    same length: equal lengths on both sides once sampled rows ignore EOS."""
    import pandas as pd
    from transformers import AutoTokenizer

    from mix_src.algo.prefix import build_prefix
    from scripts.gpu.random_model import full_length_target

    tok = AutoTokenizer.from_pretrained(tiny_random["tokenizer"])
    rows = pd.concat([pd.read_parquet(tiny_random["train"]), pd.read_parquet(tiny_random["val"])])
    targets = [tok.encode(t[0]["content"], add_special_tokens=False) for t in rows["target"]]
    assert {len(build_prefix(t, 1.0, tok.eos_token_id)) for t in targets} == {32}
    chats = [tok.apply_chat_template(list(p), add_generation_prompt=True, tokenize=False) for p in rows["prompt"]]
    assert len({len(tok.encode(c, add_special_tokens=False)) for c in chats}) == 1
    with pytest.raises(ValueError, match="raise the response length"):
        full_length_target(tok, 18, 10)


@pytest.mark.parametrize("shape,params", [("qwen2.5-0.5b", 494_032_768), ("qwen2.5-1.5b", 1_543_714_304)])
def test_gpu_shapes_are_the_presets(shape, params):
    """The GPU shapes' configs are their planner presets' (instantiated on the meta device: no weights), with
    Qwen2.5-0.5B's and -1.5B's parameter counts."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from mix_src.planner.estimate import count_params
    from scripts.gpu.random_model import SHAPES, shape_of

    kw = dict(SHAPES[shape_of(f"random:{shape}")])
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in kw.items() if k != "dtype"}))
    assert sum(p.numel() for p in model.parameters()) == params
    # the planner's count leaves out Qwen2's q/k/v biases (hidden + 2 x kv heads x head dim per layer: 0.006 %)
    head_dim = kw["hidden_size"] // kw["num_attention_heads"]
    biases = kw["num_hidden_layers"] * (kw["hidden_size"] + 2 * kw["num_key_value_heads"] * head_dim)
    assert params - count_params(kw) == biases
    assert kw["vocab_size"] == 151936 and kw["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="random:<shape>"):
        shape_of("random:qwen2.5-7b")


def test_hf_rollout_honours_rollout_ignore_eos(tiny_assets):
    """``actor_rollout_ref.rollout.ignore_eos=true`` reaches the CPU backend's server as verl's vLLM server's
    ``setdefault`` (vllm_async_server.py::generate): decoding runs past EOS to max_tokens; a request's own
    ``ignore_eos`` still wins."""
    from verl.workers.config import HFModelConfig, RolloutConfig

    from mix_src.cpu.hf_rollout import HFRolloutServer

    greedy = {"temperature": 0.0, "top_k": -1, "top_p": 1.0}
    config = RolloutConfig(name="hf", prompt_length=32, response_length=8, tensor_model_parallel_size=1,
                           dtype="float32")
    server = HFRolloutServer(config, HFModelConfig(path=tiny_assets["model"], tokenizer_path=tiny_assets["tokenizer"]))
    first = asyncio.run(server.generate([5, 6, 7], {**greedy, "ignore_eos": True}, "probe")).token_ids[0]
    server.eos_token_ids = {first}  # the greedy first token is EOS now
    lengths = {}
    for ignore in (False, True):
        server.config = dataclasses.replace(config, ignore_eos=ignore)  # actor_rollout_ref.rollout.ignore_eos
        lengths[ignore] = [len(asyncio.run(server.generate([5, 6, 7], dict(p), "r")).token_ids)
                           for p in (greedy, {**greedy, "ignore_eos": not ignore})]
    assert lengths == {False: [1, 8], True: [8, 1]}


def test_visit_fails_early_with_the_reason(tmp_path, capsys, monkeypatch):
    from scripts.gpu import visit

    assert visit.main(["--out", str(tmp_path / "a"), "--backend", "cpu", "--pieces", str(tmp_path / "none")]) == 1
    rec = json.loads((tmp_path / "a" / "visit.json").read_text())
    assert [(s["step"], s["status"]) for s in rec["steps"]] == [("host", "ok"), ("install", "failed")]
    assert rec["result"] == "FAIL" and "no such folder" in rec["reason"]
    assert "[visit] FAIL: install" in capsys.readouterr().out
    assert (tmp_path / "a" / "host.json").is_file() and (tmp_path / "a" / "pip_freeze_host.txt").stat().st_size
    # a visit split over calls (each device call <= 10 min): a call without host adds to visit.json
    assert visit.main(["--out", str(tmp_path / "b"), "--backend", "cpu", "--steps", "host"]) == 0
    assert visit.main(["--out", str(tmp_path / "b"), "--backend", "cpu", "--steps", "install", "--no-install"]) == 0
    rec = json.loads((tmp_path / "b" / "visit.json").read_text())
    assert [(s["step"], s["status"]) for s in rec["steps"]] == [("host", "ok"), ("install", "skipped")]
    assert [c["steps"] for c in rec["calls"]] == [["host"], ["install"]] and rec["result"] == "so far ok"
    with pytest.raises(SystemExit):
        visit.main(["--out", str(tmp_path / "c"), "--steps", "lunch", "--no-install"])
    which = visit.shutil.which  # no NVIDIA driver: the GPU backend stops at host, before any install
    monkeypatch.setattr(visit.shutil, "which", lambda name: None if name == "nvidia-smi" else which(name))
    assert visit.main(["--out", str(tmp_path / "d"), "--pieces", str(tmp_path)]) == 1
    assert "host: no nvidia-smi on PATH" in json.loads((tmp_path / "d" / "visit.json").read_text())["reason"]


def test_visit_installs_through_the_wheelhouse_command(tmp_path, monkeypatch):
    """The install step calls ``scripts/gpu/wheelhouse.py install --pieces DIR --python PY`` (the air-gapped
    issue's interface; a stand-in here) and fails with its last line."""
    from scripts.gpu import visit

    fake = tmp_path / "repo" / "scripts" / "gpu" / "wheelhouse.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("import json, sys\nopen(sys.argv[0] + '.args', 'w').write(json.dumps(sys.argv[1:]))\n")
    monkeypatch.setattr(visit, "REPO", tmp_path / "repo")
    (tmp_path / "pieces").mkdir()
    (tmp_path / "out").mkdir()
    assert visit.install(tmp_path / "out", sys.executable, str(tmp_path / "pieces"), None)["packages"] > 10
    assert json.loads(Path(str(fake) + ".args").read_text()) == ["install", "--pieces", str(tmp_path / "pieces"),
                                                                 "--python", sys.executable]
    visit.install(tmp_path / "out", "unused", str(tmp_path / "pieces"), str(tmp_path / "venv"))
    assert json.loads(Path(str(fake) + ".args").read_text()) == ["install", "--pieces", str(tmp_path / "pieces"),
                                                                 "--venv", str(tmp_path / "venv"),
                                                                 "--host-python", sys.executable]
    fake.write_text("print('missing wheel: ray==2.60.0'); raise SystemExit(3)\n")
    with pytest.raises(visit.StepFailed, match="exited 3: missing wheel: ray==2.60.0"):
        visit.install(tmp_path / "out", sys.executable, str(tmp_path / "pieces"), None)


def test_visit_runs_end_to_end_on_the_cpu_backend(tmp_path):
    """The visit script as on the node, on the CPU backend with the tiny shape and the CPU set already installed:
    host, imports and the smoke test (random:tiny, offline, ignore_eos) pass, every step timed in visit.json."""
    out, log = tmp_path / "visit", tmp_path / "visit.log"
    cmd = [sys.executable, "scripts/gpu/visit.py", "--backend", "cpu", "--no-install", "--out", str(out),
           "--bundle", str(tmp_path / "visit.tar.gz")]
    rc, wall, _, timed_out, _ = run_command(cmd, cpu_env(), log, timeout=600, cwd=REPO)
    assert not timed_out and rc == 0, tail(log) + "\n" + tail(out / "smoke.log")
    rec = json.loads((out / "visit.json").read_text())
    assert rec["result"] == "PASS" and [(s["step"], s["status"]) for s in rec["steps"]] == [
        ("host", "ok"), ("install", "skipped"), ("imports", "ok"), ("smoke", "ok")]
    assert all(isinstance(s["seconds"], float) for s in rec["steps"]) and rec["calls"][0]["shape"] == "tiny"
    host = json.loads((out / "host.json").read_text())
    assert host["glibc"].startswith("glibc") and (out / "pip_freeze_host.txt").read_text().count("==") > 50
    assert {"torch", "verl", "ray", "mix_src"} <= set(json.loads((out / "imports.json").read_text())["modules"])
    smoke = out / "smoke"
    text = (out / "smoke.log").read_text()
    assert "[smoke] PASS" in text and "tokens/s" in text and "planner (" in text
    train, resume = read_metrics(smoke / "train_metrics.jsonl"), read_metrics(smoke / "resume_metrics.jsonl")
    assert [m["step"] for m in train] == [1, 2] and [m["step"] for m in resume] == [3]  # resumed from global_step_2
    assert (smoke / "checkpoints" / "global_step_2" / "actor").is_dir()
    assert "global_step_2" in (smoke / "resume.log").read_text()  # verl's "Load from checkpoint folder" line
    for m in train + resume:  # prefixed and sampled rows alike: the whole response (ignore_eos, full-length targets)
        assert m["response_length/min"] == m["response_length/max"] == 32 and m["batch/off_policy_rows"] > 0
    with tarfile.open(tmp_path / "visit.tar.gz") as tar:
        names = tar.getnames()
    assert "visit/visit.json" in names and "visit/smoke.log" in names
    assert not any(n.endswith((".safetensors", ".parquet")) or "/checkpoints" in n for n in names)


def test_random_model_runs_are_offline(monkeypatch, tmp_path):
    """``random:`` turns the Hub off for the smoke's runs: HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE in their
    environment (huggingface_hub then raises on any download instead of reaching the network)."""
    from scripts.gpu import random_model, smoke

    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # setenv first: the suite's value comes back afterwards
        monkeypatch.setenv(key, "0")
        monkeypatch.delenv(key)
    assert "HF_HUB_OFFLINE" not in smoke.environment("gpu", tmp_path / "m.jsonl")
    random_model.offline()
    env = smoke.environment("gpu", tmp_path / "m.jsonl")
    assert (env["HF_HUB_OFFLINE"], env["TRANSFORMERS_OFFLINE"]) == ("1", "1")
