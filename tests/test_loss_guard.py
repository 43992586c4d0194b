"""The loss refactor guard (issue #38 item 3): the LUFFY kernel and the worker loss give, bit for bit, the outputs
recorded in ``tests/guard/loss_outputs.pt.gz`` before the loss became a registry of terms (recorded at 6a5b851).

Every case runs on seeded inputs built here (nothing but the outputs is stored): the kernel's pg_loss, every metric
it returns and d pg_loss / d log_prob, over its options (each on/off-policy reshape, the aliases, target_probs,
behaviour log-probs, f clips, all_max_clip, per-row and global loss_remove_clip, dual clip, rollout-IS weights,
every aggregation mode with verl's global batch numbers, the +-20 log-ratio clamp); and the worker loss
(``MixPolicyLoss`` through verl's micro-batch loop, tests/test_loss.py) for tests/test_loss.py's configurations plus
the SFT multitask term, a row loss, a loss combination, recorded behaviour log-probs, per-row clip removal, rollout-IS
weights, both adaptive entropy variants and verl's other policy losses: each micro-batch's loss and metrics and the
model's gradient. ``torch.equal`` everywhere (a NaN metric equals a NaN). ~10 s.

Bit for bit where this machine's kernel fingerprint (tests/kernels.py) equals the record's
(``tests/guard/loss_outputs.fingerprint.json``), within ``kernels.ULPS`` float32 ulps elsewhere (another kernel set,
torch build or architecture). ``LOSS_GUARD_RECORD=1`` rewrites both files (only on purpose, saying why in the commit).
"""

from __future__ import annotations

import gzip
import io
import json
import math
import os
from pathlib import Path

import pytest
import torch
from verl.utils import tensordict_utils as tu

from mix_src.algo.core_alg import compute_token_on_off_policy_loss, kept_tokens_per_mini_batch
from mix_src.worker.loss import REMOVE_CLIP, MixPolicyLoss
from mix_src.algo.off_policy_behaviour import BEHAVIOUR_LOG_PROB
from mix_src.algo.row_loss import ROW_LOSSES, SFT_ROW, SFT_TOKENS
from kernels import F32_EPS, ULPS, fingerprint, fingerprint_diff, within_ulps
from test_loss import CONFIGS, BigramLM, actor_config, add_kept_counts, make_batch, run_mini_batch
from test_onpolicy_losses import mode_config

RECORD = Path(__file__).resolve().parent / "guard" / "loss_outputs.pt.gz"
RECORD_FINGERPRINT = RECORD.with_name("loss_outputs.fingerprint.json")
B, L = 4, 6
_AGG = dict(dp_size=2, batch_num_tokens=30, global_batch_size=7, loss_scale_factor=9.0)

KERNEL_CASES = {
    **{f"on_{m}": dict(on_policy_reshape=m) for m in ("no_reshape", "logp", "p_logp", "square_root", "pow", "p_div_p")},
    **{f"off_{m}": dict(off_policy_reshape=m) for m in ("no_reshape", "logp", "p_logp", "square_root", "pow", "p_div_p",
                                                         "p_div_p_0.3")},
    "off_p_div_p_gamma_weights": dict(off_policy_reshape="p_div_p", off_policy_reshape_gamma=0.25,
                                      on_policy_reshape="p_div_p", on_policy_reshape_gamma=0.4),
    "reshape_knobs": dict(off_policy_reshape="p_logp", off_policy_reshape_weight=0.3, on_policy_reshape="pow",
                          on_policy_reshape_pow_exp=0.7),
    "target_probs": dict(target_probs=True),
    "behaviour": dict(off_policy_reshape="p_div_p", behaviour_log_prob=True),
    "off_clips": dict(off_policy_reshape="no_reshape", off_max_clip=0.5, off_min_clip=0.1),
    "all_max_clip": dict(off_policy_reshape="p_div_p", all_max_clip=0.4),
    "remove_clip": dict(loss_remove_clip=True, off_policy_reshape="p_div_p"),
    "remove_clip_rows": dict(loss_remove_clip="rows"),
    "dual_clip": dict(clip_ratio_c=3.0, clip_upper_bound=1.3, cliprange=0.1),
    "rollout_is": dict(rollout_is_weights=True, clip_ratio_c=3.0),
    **{f"agg_{m}": dict(loss_agg_mode=m) for m in ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
                                                    "seq-mean-token-sum-norm", "luffy-token-sum-norm")},
    **{f"agg_global_{m}": dict(loss_agg_mode=m, **_AGG) for m in ("token-mean", "seq-mean-token-mean",
                                                                   "seq-mean-token-sum-norm", "luffy-token-sum-norm")},
    "log_ratio_clamp": dict(on_policy_reshape="p_logp", clamp=True),
    "log_ratio_clamp_p_div_p": dict(on_policy_reshape="p_div_p", clamp=True),
    "no_prefix": dict(prefix="none"),
    "all_prefix": dict(prefix="all", off_policy_reshape="p_div_p"),
}  # fmt: skip


def kernel_inputs(seed: int = 0, prefix: str = "mixed", clamp: bool = False):
    """(B, L) float32 inputs: right-padded rows, row 0 all prefix, row 1 two prefix tokens (prefix="mixed")."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(L)[None, :] < torch.tensor([L, 4, 5, 2])[:, None]
    lp = (-torch.rand(B, L, generator=g) * 3).masked_fill(~mask, 0.0)
    old = (lp + 0.4 * torch.randn(B, L, generator=g)).masked_fill(~mask, 0.0)
    if clamp:
        old[2, 1], old[3, 0] = lp[2, 1] - 25.0, lp[3, 0] + 30.0
    adv = (torch.randn(B, 1, generator=g) * mask).contiguous()
    prefix_mask = torch.zeros(B, L, dtype=torch.bool)
    if prefix == "mixed":
        prefix_mask[0], prefix_mask[1, :2] = mask[0], True
    elif prefix == "all":
        prefix_mask = mask.clone()
    extra = dict(target_probs=torch.rand(B, L, generator=g) * 0.8 + 0.1,
                 behaviour_log_prob=lp - 0.3 * torch.rand(B, L, generator=g),
                 rollout_is_weights=torch.rand(B, L, generator=g) + 0.5)  # fmt: skip
    return old, lp, adv, mask, prefix_mask, extra


def run_kernel(case: dict) -> dict:
    kwargs = dict(case)
    old, lp, adv, mask, prefix_mask, extra = kernel_inputs(prefix=kwargs.pop("prefix", "mixed"),
                                                           clamp=kwargs.pop("clamp", False))  # fmt: skip
    for key in ("target_probs", "behaviour_log_prob", "rollout_is_weights"):
        if kwargs.get(key) is True:
            kwargs[key] = extra[key]
    if kwargs.get("loss_remove_clip") == "rows":
        kwargs["loss_remove_clip"] = torch.tensor([[True], [False], [True], [False]])
    lp = lp.clone().requires_grad_(True)
    out = compute_token_on_off_policy_loss(old, lp, adv, mask, prefix_mask, **kwargs)
    (grad,) = torch.autograd.grad(out["pg_loss"], lp)
    return {**{k: v.detach() for k, v in out.items()}, "grad": grad}


def _worker_data(case: str, model):
    data = make_batch(seed=3, model=model)
    rows, response_mask = data["response_mask"].shape[0], data["response_mask"].bool()
    if case in ("all_max_clip_token_mean", "all_max_clip_token_mean_kl"):
        add_kept_counts(data, CONFIGS[case][1]["all_max_clip"])
    if case == "row_loss":
        data[SFT_ROW] = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 0.0])
        _, sft = ROW_LOSSES.get("sft_rows")(response_mask, data["prefix_mask"].bool() & response_mask,
                                            data[SFT_ROW].bool())  # fmt: skip
        data[SFT_TOKENS] = kept_tokens_per_mini_batch(sft, 1, rows).float()
    if case == "behaviour":
        data[BEHAVIOUR_LOG_PROB] = data["old_log_probs"] - 0.2 * response_mask
    if case == "remove_clip_rows":
        data[REMOVE_CLIP] = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    if case in ("rollout_is", "gspo_rollout_is"):
        data["rollout_is_weights"] = (torch.linspace(0.5, 1.5, rows * response_mask.shape[1]).reshape(rows, -1)
                                      * response_mask)  # fmt: skip
    return data


WORKER_CASES = {
    **CONFIGS,
    "adaptive_entropy_fixed": ({}, dict(adaptive_entropy_fixed=True, target_entropy=0.7)),
    "row_loss": ({}, dict(row_loss="sft_rows", sft_loss_coef=0.3, loss_remove_clip=True)),
    "behaviour": ({}, dict(off_policy_behaviour="stored_log_prob", off_policy_reshape="p_div_p")),
    "remove_clip_rows": (dict(clip_ratio_c=3.0), {}),
    "rollout_is": ({}, dict(on_policy_reshape="p_div_p")),
    **{f"mode_{m}": (dict(policy_loss=m), {}) for m in ("gspo", "cispo", "sapo", "geo_mean", "gpg", "dro")},
    "gspo_rollout_is": (dict(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean"), dict(clip_upper_bound=1.5)),
}  # fmt: skip


def _metric_values(metrics: dict) -> dict:
    out = {}
    for key, value in metrics.items():
        values = getattr(value, "values", value)
        out[key] = torch.as_tensor(values if isinstance(values, (list, tuple)) else [values], dtype=torch.float64)
    return out


def run_worker(case: str) -> dict:
    actor, mix = WORKER_CASES[case]
    actor = dict(actor)
    model = BigramLM(seed=2)
    data = _worker_data(case, model)
    mode = actor.pop("policy_loss", None)
    config = actor_config(**actor) if mode is None else mode_config(mode, **actor)
    loss_fn = MixPolicyLoss(config, dict(mix))
    results = {}
    for micro in (2, 6):
        tu.assign_non_tensor(data, micro_batch_size_per_gpu=micro)
        total, grad, metrics = run_mini_batch(loss_fn, data, micro, model)
        results[f"mb{micro}/total"] = torch.tensor(total, dtype=torch.float64)
        results[f"mb{micro}/grad"] = grad
        for i, m in enumerate(metrics):
            results.update({f"mb{micro}/{i}/{k}": v for k, v in _metric_values(m).items()})
    return results


# torch's intra-op threads when the record was made (a 2-core machine). How a CPU kernel splits a sum depends on it,
# so some gradients' last bits do (1 thread: up to 1.9e-9 apart); a test earlier in the same process can change it
# (scripts/experiments' toy trainers set 1), as under `make test`'s pytest workers. Pinned while the outputs are made.
RECORD_THREADS = 2


def _all_outputs() -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(RECORD_THREADS)
    try:
        out = {f"kernel/{name}": run_kernel(case) for name, case in KERNEL_CASES.items()}
        out.update({f"worker/{name}": run_worker(name) for name in WORKER_CASES})
    finally:
        torch.set_num_threads(threads)
    return out


def _pack(outputs: dict) -> dict:
    """{case: {name: tensor}} -> {case: (index, float32 values, float64 values)}: two flat tensors per case keep the
    file small (one storage per tensor otherwise)."""
    packed = {}
    for case, tensors in outputs.items():
        index, flat = [], {torch.float32: [], torch.float64: []}
        for name, t in sorted(tensors.items()):
            index.append((name, str(t.dtype), tuple(t.shape)))
            flat[t.dtype].append(t.detach().reshape(-1))
        packed[case] = (index, *(torch.cat(v) if v else torch.zeros(0, dtype=d) for d, v in flat.items()))
    return packed


def _unpack(packed: dict) -> dict:
    out = {}
    for case, (index, f32, f64) in packed.items():
        pos, tensors = {"torch.float32": 0, "torch.float64": 0}, {}
        for name, dtype, shape in index:
            flat, n = (f32 if dtype == "torch.float32" else f64), math.prod(shape)
            tensors[name] = flat[pos[dtype]:pos[dtype] + n].reshape(shape)
            pos[dtype] += n
        out[case] = tensors
    return out


def _load() -> dict:
    return _unpack(torch.load(io.BytesIO(gzip.decompress(RECORD.read_bytes()))))


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.skipif(os.environ.get("LOSS_GUARD_RECORD") != "1", reason="records the guard file (LOSS_GUARD_RECORD=1)")
def test_record():
    buffer = io.BytesIO()
    torch.save(_pack(_all_outputs()), buffer)
    RECORD.write_bytes(gzip.compress(buffer.getvalue(), mtime=0))
    RECORD_FINGERPRINT.write_text(json.dumps(fingerprint(RECORD_THREADS), indent=1, sort_keys=True) + "\n")


def compare(recorded: dict, now: dict, exact: bool) -> list[str]:
    """The differing outputs, bit for bit (``exact``) or within ``ULPS``."""
    same = _equal if exact else within_ulps
    assert sorted(now) == sorted(recorded)
    diffs = []
    for case, want in recorded.items():
        got = now[case]
        assert sorted(got) == sorted(want), f"{case}: outputs {sorted(set(got) ^ set(want))} appear or disappear"
        diffs += [f"{case}/{k}: max |diff| {(got[k].double() - want[k].double()).abs().max().item():.3g}"
                  for k in want if not same(got[k], want[k])]  # fmt: skip
    return diffs


def test_loss_outputs_match_the_record():
    """Bit for bit on the record's kernels (the suite pins them on x86-64, tests/kernels.py), within ULPS elsewhere."""
    machine = fingerprint_diff(fingerprint(RECORD_THREADS), json.loads(RECORD_FINGERPRINT.read_text()))
    diffs = compare(_load(), _all_outputs(), exact=not machine)
    how = f"within {ULPS} float32 ulps (kernels differ from the record's: {machine})" if machine else "bit-identical"
    assert not diffs, f"not {how} to the record:\n" + "\n".join(diffs)


def test_the_guard_sees_a_one_ulp_change_where_exact_and_a_change_beyond_the_tolerance_elsewhere():
    """Exact mode: one float32 ulp on one recorded value is a difference. Tolerance mode: ULPS ulps of the tensor's
    scale pass, twice that is a difference, and a NaN for a number is one."""
    recorded = _load()
    case, name = "kernel/off_p_div_p", "grad"
    want = recorded[case][name]
    one_ulp = {c: dict(t) for c, t in recorded.items()}
    one_ulp[case][name] = want.clone()
    one_ulp[case][name][0, 0] = torch.nextafter(want[0, 0], torch.tensor(math.inf))
    assert len(compare(recorded, one_ulp, exact=True)) == 1
    assert compare(recorded, one_ulp, exact=False) == []
    scale = want.abs().max().item() * F32_EPS
    for factor, caught in ((ULPS * 0.99, False), (ULPS * 2, True)):
        moved = {c: dict(t) for c, t in recorded.items()}
        moved[case][name] = want.clone()
        moved[case][name][0, 0] += factor * scale
        assert bool(compare(recorded, moved, exact=False)) is caught, factor
    nan = {c: dict(t) for c, t in recorded.items()}
    nan[case][name] = want.clone()
    nan[case][name][0, 0] = math.nan
    assert compare(recorded, nan, exact=False)
