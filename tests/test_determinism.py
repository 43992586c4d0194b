"""Seeded runs reproduce: per-request sampling seeds (mix_src.algo.seeding) and the batch-invariant hf rollout.

Unit tests check the seed derivation and that the hf sampler's output for a request depends on its seed and
prompt only (not on the requests batched with it). The end-to-end check -- the cpu_tiny recipe twice with the
same seeds, every logged metric compared except timing/throughput, step by step -- is in the opt-in tier
(tests/test_recipes.py::test_cpu_tiny_demo_reproduces_seeded); in make test the guards (tests/test_guard.py) compare
seeded runs with a record.
"""

from __future__ import annotations

import asyncio
import random
import re

import numpy as np
import pytest
import torch

from mix_src.cpu.sampling import ROW_MULTIPLE, SamplingSpec, generate_batch, sample_inverse_cdf
from mix_src.algo.seeding import fallback_seed, request_seeds


# Metrics that measure time, speed or the machine's memory (or pick the slowest request), hence differ between
# identical runs: timing_s/*, timing_per_token_ms/*, perf/* and actor/perf/* (throughput, MFU, memory in use).
TIMING_KEYS = re.compile(r"^(timing_s|timing_per_token_ms)/|(^|/)perf/")


def test_request_seeds_depend_on_every_coordinate():
    seeds = request_seeds(7, global_step=3, gen_index=0, num_prompts=4, n=8)
    assert seeds.shape == (32,) and seeds.dtype == np.int64 and (seeds >= 0).all()
    assert len(set(seeds.tolist())) == 32  # every (prompt, sample) its own seed
    assert np.array_equal(seeds, request_seeds(7, 3, 0, 4, 8))  # a pure function
    for other in (request_seeds(8, 3, 0, 4, 8), request_seeds(7, 4, 0, 4, 8), request_seeds(7, 3, 1, 4, 8)):
        assert not set(other.tolist()) & set(seeds.tolist())  # rollout seed, step, generation batch
    assert request_seeds(7, 3, 0, 5, 8)[:32].tolist() == seeds.tolist()  # row (i, j) ignores the batch size
    assert fallback_seed(7, 0) != fallback_seed(7, 1) and fallback_seed(7, 0) not in seeds.tolist()
    with pytest.raises(ValueError, match="non-negative"):
        request_seeds(-1, 0, 0, 1, 1)


def test_inverse_cdf_sampling():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.2, 0.0, 0.8, 0.0]])
    draw = lambda u: sample_inverse_cdf(probs, torch.tensor(u, dtype=torch.float64)).tolist()  # noqa: E731
    assert draw([0.0, 0.0]) == [1, 0]  # zero-mass tokens are never drawn
    assert draw([0.49, 0.21]) == [1, 2] and draw([0.5, 0.999]) == [3, 2]
    assert draw([1 - 2**-53, 1 - 2**-53]) == [3, 2]  # u * total rounding up to total
    counts = torch.bincount(sample_inverse_cdf(probs[:1].expand(20000, 4), torch.rand(20000, dtype=torch.float64)))
    assert abs(counts[1].item() / 20000 - 0.5) < 0.02


@pytest.fixture(scope="module")
def tiny_model(tiny_assets):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        tiny_assets["model"], dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_do_not_depend_on_their_batch(tiny_model, threads):
    """Same seed and prompt -> bit-identical tokens and log-probs, alone or in any batch (same width)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 40) for _ in range(rng.randrange(15, 30))] for _ in range(40)]
    specs = [SamplingSpec(max_tokens=12, logprobs=True, ignore_eos=True, seed=100 + i) for i in range(40)]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = generate_batch(tiny_model, prompts, specs, set(), 0, width=32)
        for lo, hi in [(0, 1), (3, 5), (7, 10), (11, 28), (39, 40), (1, 40)]:
            assert generate_batch(tiny_model, prompts[lo:hi], specs[lo:hi], set(), 0, width=32) == full[lo:hi], (lo, hi)
    finally:
        torch.set_num_threads(old)
    assert ROW_MULTIPLE % 4 == 0
    again = generate_batch(tiny_model, prompts[:4], [SamplingSpec(12, seed=100 + i) for i in range(4)], set(), 0)
    assert [t for t, _ in again] == [t for t, _ in generate_batch(tiny_model, prompts[:4], specs[:4], set(), 0)]
    reseeded = generate_batch(tiny_model, prompts[:4], [SamplingSpec(12, seed=999 + i) for i in range(4)], set(), 0)
    assert [t for t, _ in reseeded] != [t for t, _ in again]


def test_server_answers_by_seed_not_arrival_order(tiny_assets):
    """The server's answer to a seeded request does not depend on the order or company it arrives in."""
    from verl.workers.config import HFModelConfig, RolloutConfig

    from mix_src.cpu.hf_rollout import HFRolloutServer

    config = RolloutConfig(name="hf", prompt_length=32, response_length=12, tensor_model_parallel_size=1,
                           dtype="float32")
    server = HFRolloutServer(config, HFModelConfig(path=tiny_assets["model"], tokenizer_path=tiny_assets["tokenizer"]))
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 40) for _ in range(rng.randrange(10, 40))] for _ in range(12)]  # 2 widths

    async def ask(order):
        order = list(order)
        outs = await asyncio.gather(
            *[server.generate(prompts[i], {"temperature": 1.0, "logprobs": True, "seed": 5 + i}, f"r{i}") for i in order]
        )
        return {i: (o.token_ids, o.log_probs) for i, o in zip(order, outs)}

    forward = asyncio.run(ask(range(12)))
    assert forward == asyncio.run(ask(reversed(range(12))))
    assert {i: forward[i] for i in (2, 9)} == asyncio.run(ask([9, 2]))


def _same(x, y) -> bool:
    return x == y or (isinstance(x, float) and isinstance(y, float) and x != x and y != y)  # NaN == NaN


def test_blocked_logprobs_match_verls_row_loop(monkeypatch):
    """The CPU backend's log-prob helper is bit-identical to verl's per-row fallback, values and gradients."""
    import verl.utils.torch_functional as tf

    from mix_src.cpu import logprobs

    logprobs.patch_logprobs(tf)
    assert tf.logprobs_from_logits_v2 is logprobs.logprobs_from_logits_chunked
    verl_v2 = logprobs._VERL_LOGPROBS_V2
    logits = (torch.randn(300, 45, dtype=torch.float32) * 3).requires_grad_()
    labels = torch.randint(0, 45, (300,))
    for chunk in (logprobs._CHUNK_ELEMENTS, 45 * 7):  # one block; blocks of 7 rows
        monkeypatch.setattr(logprobs, "_CHUNK_ELEMENTS", chunk)
        ours = tf.logprobs_from_logits(logits, labels)
        (g_ours,) = torch.autograd.grad(ours.sum(), logits)
        theirs = verl_v2(logits, labels)
        (g_theirs,) = torch.autograd.grad(theirs.sum(), logits)
        assert torch.equal(ours, theirs) and torch.equal(g_ours, g_theirs)
    half = logits.detach().bfloat16()
    assert torch.equal(tf.logprobs_from_logits(half, labels), verl_v2(half, labels))  # verl's own bf16 path


def test_agent_loop_sends_the_row_seed_to_the_server(tiny_assets):
    """The trainer's ``rollout_seed`` goes out as ``sampling_params["seed"]``; without one (validation) the
    row's position (verl's ``priority``) picks it; prefix rows make no call and need none."""
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap

    from mix_src.rollout.agent_loop import PrefixGuidedAgentLoop
    from mix_src.trainer.dataset import RLHFDatasetWithTarget

    from test_dataset_agent_loop import RecordingServer

    tok = AutoTokenizer.from_pretrained(tiny_assets["tokenizer"])
    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {"response_length": 16, "prompt_length": 64, "seed": 11,
                                                              "calculate_log_probs": True}}, "data": {}})  # fmt: skip
    server = RecordingServer(tok.convert_tokens_to_ids("7"))
    loop = PrefixGuidedAgentLoop(trainer_config=DictConfigWrap(cfg), server_manager=server, tokenizer=tok,
                                 processor=None, dataset_cls=RLHFDatasetWithTarget, data_config=DictConfigWrap(cfg.data))

    def run(**kw):
        coro = loop.run({"temperature": 1.0}, raw_prompt=[{"role": "user", "content": "1+2?"}], **kw)
        loop.loop.run_until_complete(coro)
        return server.calls[-1]["sampling_params"].get("seed")

    assert run(rollout_seed=np.int64(123), priority=5) == 123
    assert run(priority=5) == fallback_seed(11, 5) != run(priority=6)
    assert run() == fallback_seed(11, 0)  # verl always sets priority; 0 is its default
    # V1 sets no priority (every request 0): the data index and the sample keep seeds apart
    v1 = {(i, j): run(index=i, session_id=j) for i in (3, 4) for j in (0, 1)}
    assert len(set(v1.values())) == 4 and v1[(3, 1)] == fallback_seed(11, 3, 1)


def test_full_determinism_request_ids_stay_distinct_on_v1():
    from mix_src.rollout.agent_loop import PrefixGuidedAgentLoop

    rid = PrefixGuidedAgentLoop.deterministic_request_id
    assert rid({}, 5) == "det-5"  # verl's own id on the legacy trainer
    ids = {rid({"index": i, "session_id": j}, 0) for i in (0, 1) for j in (0, 1, 2)}
    assert len(ids) == 6  # V1: every request has priority 0; vLLM refuses a running request's id


def test_later_rollout_passes_get_new_reproducible_seeds():
    from mix_src.algo.seeding import pass_seeds

    seeds = request_seeds(7, 3, 0, 2, 4)
    assert np.array_equal(pass_seeds(seeds, 0), seeds)
    second = pass_seeds(seeds, 1)
    assert np.array_equal(second, pass_seeds(seeds, 1))
    assert not set(second.tolist()) & set(seeds.tolist()) and len(set(second.tolist())) == len(seeds)
