"""The "hf" rollout: a transformers model served from a Ray actor, plugged into verl's rollout registries as a
server, a replica and an in-worker adapter, mirroring verl's vLLM backend (``verl/workers/rollout/vllm_rollout/``).
Only text prompts; rollout TP/DP/PP must be 1 per replica.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import os
from typing import Any, Generator, Optional

import ray
import torch

from verl.utils.config import omega_conf_to_dataclass
from verl.utils.torch_dtypes import PrecisionType
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput
from verl.workers.rollout.utils import ensure_async_iterator

from .sampling import SamplingSpec, generate_batch

logger = logging.getLogger(__name__)  # its level: mix_src.cpu's (VERL_LOGGING_LEVEL)

# Requests are gathered into one decoding batch until none has arrived for this long (or max_num_seqs are
# pending): verl's agent loop sends them one by one, a few ms apart, and each batch pays a whole decoding
# loop (measured: scripts/bench/README.md). Results do not depend on the grouping (generate_batch), only the time.
_BATCH_QUIET_S = 0.03


async def _nothing(self, *args, **kwargs) -> None:
    """A lifecycle call verl makes on a server with device memory; there is none on CPU."""


def server_name(replica_rank: int, name_suffix: str = "") -> str:
    """Ray actor name of a replica's server; the in-worker adapter finds its server by this name."""
    return f"mix_src_hf_rollout_server_{replica_rank}{name_suffix}"


def _base_name(name: str) -> str:
    """A weight's HF name whether or not peft wraps its module (``base_model.model.`` / ``.base_layer``)."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


class HFRolloutServer:
    """Token-in/token-out generation server on an fp32 copy of the policy (wrapped with ``ray.remote`` by
    ``HFReplica``): concurrent requests decoded in one batch, bit-identical whatever shares it (``generate_batch``)."""

    def __init__(self, config: RolloutConfig, model_config: HFModelConfig, replica_rank: int = 0):
        from transformers import AutoModelForCausalLM

        self.config: RolloutConfig = omega_conf_to_dataclass(config)
        # The replica hands over the model config as a DictConfig (verl/workers/rollout/replica.py).
        self.model_config: HFModelConfig = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        self.replica_rank = replica_rank
        self.global_steps: Optional[int] = None

        mc = self.model_config
        attn = dict(mc.override_config or {}).get("attn_implementation", "eager")
        self.dtype = PrecisionType.to_dtype(self.config.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(mc.local_path, dtype=self.dtype, attn_implementation=attn,
                                                          trust_remote_code=mc.trust_remote_code)
        self.model.eval()
        eos = [getattr(src, "eos_token_id", None) for src in (mc.generation_config, mc.hf_config, mc.tokenizer)]
        self.eos_token_ids = {int(i) for e in eos if e is not None for i in (e if isinstance(e, list | tuple) else [e])}
        pad = getattr(mc.tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad if pad is not None else min(self.eos_token_ids or {0}))
        self.max_model_len = self.config.max_model_len or (self.config.prompt_length + self.config.response_length)
        self.max_batch = max(1, int(self.config.max_num_seqs))
        self.generator = torch.Generator().manual_seed(int(self.config.seed) + replica_rank)

        self.stats = {"requests": 0, "batches": 0, "decode_s": 0.0}  # requests served, decoding batches, time
        self._logged = dict(self.stats)
        self._pending: list[tuple[list[int], SamplingSpec, asyncio.Future]] = []
        self._worker: Optional[asyncio.Task] = None
        self._lock = asyncio.Lock()  # the model: decoding batches and weight loads, one at a time
        logger.info("mix_src.cpu: hf rollout server %d ready (%s, attn=%s, %s, eos=%s)", replica_rank,
                    mc.local_path, attn, self.dtype, sorted(self.eos_token_ids))  # fmt: skip

    def ready(self) -> bool:
        return True

    def get_stats(self) -> dict:
        return dict(self.stats)

    # ------------------------------------------------------------------ generation
    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data: Optional[list[Any]] = None, video_data: Optional[list[Any]] = None,
                       audio_data: Optional[list[Any]] = None, mm_processor_kwargs: Optional[dict[str, Any]] = None,
                       priority: int = 0, **kwargs) -> TokenOutput:
        if image_data or video_data or audio_data:
            raise NotImplementedError("hf rollout serves text prompts only")
        prompt_ids = [int(t) for t in prompt_ids]
        max_possible = self.max_model_len - len(prompt_ids)
        if max_possible < 0:
            raise ValueError(f"hf rollout: prompt of {len(prompt_ids)} tokens exceeds max_model_len "
                             f"{self.max_model_len}")  # fmt: skip
        c = self.config  # default max_tokens as verl's vLLM server's (vllm_async_server.py::generate)
        default_max = min(c.response_length, c.prompt_length + c.response_length - len(prompt_ids))
        # rollout.ignore_eos unless the request says otherwise, as the vLLM server's setdefault
        spec = SamplingSpec.from_params({"ignore_eos": c.ignore_eos, **sampling_params}, default_max, max_possible)

        future = asyncio.get_running_loop().create_future()
        self._pending.append((prompt_ids, spec, future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        token_ids, log_probs, version = await future
        # global_steps: the weights it was decoded with (a sync may follow at once)
        return TokenOutput(token_ids=token_ids, log_probs=log_probs if spec.logprobs else None,
                           stop_reason="completed", extra_fields={"global_steps": version})

    def batch_width(self, prompt_len: int) -> int:
        """Left-padded width of a prompt's decoding batch, a function of its own length only (so its
        log-probs do not depend on which requests it is batched with): ``prompt_length``, or the next
        multiple of 16 for longer prompts (prompt + prefix)."""
        if prompt_len <= self.config.prompt_length:
            return int(self.config.prompt_length)
        return min(-(-prompt_len // 16) * 16, max(self.max_model_len, prompt_len))

    async def _gather(self) -> None:
        """Wait while requests keep arriving: until none came in ``_BATCH_QUIET_S`` or a batch is full."""
        while True:
            pending = len(self._pending)
            await asyncio.sleep(_BATCH_QUIET_S)
            if len(self._pending) == pending or len(self._pending) >= self.max_batch:
                return

    async def _drain(self):
        """Decode everything pending: requests of equal ``batch_width``, at most ``max_num_seqs`` per batch."""
        loop = asyncio.get_running_loop()
        while self._pending:
            await self._gather()
            width = self.batch_width(len(self._pending[0][0]))
            batch = [r for r in self._pending if self.batch_width(len(r[0])) == width][: self.max_batch]
            taken = {id(r) for r in batch}
            self._pending = [r for r in self._pending if id(r) not in taken]
            prompts, specs, futures = zip(*batch, strict=True)
            try:
                async with self._lock:
                    t0 = loop.time()
                    version = self.global_steps  # the weights this batch is decoded with
                    results = await asyncio.to_thread(generate_batch, self.model, list(prompts), list(specs),
                                                      self.eos_token_ids, self.pad_token_id, self.generator, width)
            except Exception as e:  # hand the error to every waiting request
                for f in futures:
                    if not f.done():
                        f.set_exception(e)
                continue
            self.stats["batches"] += 1
            self.stats["requests"] += len(futures)
            self.stats["decode_s"] += loop.time() - t0
            for f, r in zip(futures, results, strict=True):
                if not f.done():
                    f.set_result((*r, version))

    # ------------------------------------------------------------------ weights
    async def update_weights(self, state_dict: dict[str, torch.Tensor], global_steps: Optional[int] = None) -> None:
        """Load the actor's full weights (HF names) between decoding batches."""
        async with self._lock:
            await asyncio.to_thread(self._load, state_dict)
            if global_steps is not None:
                self.global_steps = global_steps
        new = {k: self.stats[k] - self._logged[k] for k in self.stats}
        if new["requests"]:
            logger.info("mix_src.cpu: hf rollout %d served %d requests in %d decoding batches (%.2f s) since the last "
                        "sync", self.replica_rank, new["requests"], new["batches"], new["decode_s"])  # fmt: skip
        self._logged = dict(self.stats)

    def _load(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Full weights by HF name. Under a LoRA adapter (``update_lora`` wrapped the model) they go to the base
        layers: verl's base sync names a LoRA-wrapped linear ``<module>.base_layer.weight``
        (``verl.utils.fsdp_utils.replace_lora_wrapper``); both spellings map to the same base weight."""
        own = {_base_name(k): v for k, v in self.model.state_dict().items() if ".lora_" not in k}
        state_dict = {_base_name(k): v for k, v in state_dict.items()}
        unexpected = sorted(set(state_dict) - set(own))
        if unexpected:
            raise KeyError(f"hf rollout: weights not in the rollout model: {unexpected[:5]} ...")
        with torch.no_grad():
            for name, tensor in state_dict.items():
                own[name].copy_(tensor.to(own[name].dtype))
        received = {own[n].data_ptr() for n in state_dict}
        missing = [n for n in own if n not in state_dict and own[n].data_ptr() not in received]
        if missing:  # tied weights share storage with a received tensor and are fine
            raise KeyError(f"hf rollout: actor sent no value for {missing[:5]} ...")

    async def update_lora(self, tensors: dict[str, torch.Tensor], peft_config: Any, global_steps: Optional[int] = None):
        """Load the actor's LoRA adapter (``peft.get_peft_model_state_dict`` tensors) with the actor's peft LoRA
        layers, as verl's vLLM rollout adds them with ``add_lora``."""
        async with self._lock:
            await asyncio.to_thread(self._load_lora, tensors, peft_config)
            if global_steps is not None:
                self.global_steps = global_steps

    def _load_lora(self, tensors: dict[str, torch.Tensor], peft_config: Any) -> None:
        from peft import PeftConfig, PeftModel, get_peft_model, set_peft_model_state_dict

        if isinstance(peft_config, dict):  # verl sends peft_config.to_dict() (transformer_impl.py:1060)
            peft_config = PeftConfig.from_peft_type(**peft_config)
        if not isinstance(self.model, PeftModel):
            self.model = get_peft_model(self.model, copy.deepcopy(peft_config))
            self.model.eval()
        with torch.no_grad():
            tensors = {k: v.to(self.dtype) for k, v in tensors.items()}
            result = set_peft_model_state_dict(self.model, tensors)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise KeyError(f"hf rollout: LoRA tensors not in the rollout model: {unexpected[:5]} ...")
        lora_b = [v for k, v in tensors.items() if "lora_B" in k]
        self.stats["lora_syncs"] = self.stats.get("lora_syncs", 0) + 1
        logger.info("mix_src.cpu: hf rollout %d loaded LoRA adapter #%d (%d tensors, r=%s, |lora_B|=%.6g)",
                    self.replica_rank, self.stats["lora_syncs"], len(tensors), getattr(peft_config, "r", "?"),
                    float(torch.sqrt(sum((b.double() ** 2).sum() for b in lora_b))) if lora_b else 0.0)

    # ------------------------------------------------------------------ lifecycle: nothing to free on CPU
    wake_up = sleep = clear_kv_cache = release_kv_cache = resume_kv_cache = _nothing
    resume_generation = start_profile = stop_profile = _nothing

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        return {}


class HFReplica(RolloutReplica):
    """``RolloutReplicaRegistry["hf"]``: one ``HFRolloutServer`` per replica (world size 1)."""

    async def launch_servers(self):
        if self.world_size != 1:
            raise ValueError(f"hf rollout needs one rank per replica, got tensor*data*pipeline parallel = "
                             f"{self.world_size}; set actor_rollout_ref.rollout.tensor_model_parallel_size=1 (the CPU "
                             "backend config does)")
        options: dict[str, Any] = {"name": server_name(self.replica_rank, self.name_suffix),
                                   "max_concurrency": self.max_concurrency}  # fmt: skip
        if self.workers:  # place the server next to the worker that pushes weights to it
            node_id = await self.workers[0].__ray_call__.remote(lambda w: ray.get_runtime_context().get_node_id())
            strategy = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
            options["scheduling_strategy"] = strategy
        server = ray.remote(HFRolloutServer).options(**options).remote(
            config=self.config, model_config=self.model_config, replica_rank=self.replica_rank)  # fmt: skip
        await server.ready.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"hf-{options['name']}"


class HFServerAdapter(BaseRollout):
    """``_ROLLOUT_REGISTRY[("hf", "async")]``, in the actor worker or in verl's ``CheckpointEngineWorker`` beside a
    standalone server (separate_async): pushes the weights to this replica's server through Ray (full, or with LoRA
    the base once and then the adapter, applied with peft's LoRA layers)."""

    def __init__(self, config: RolloutConfig, model_config: HFModelConfig, device_mesh, replica_rank: int = -1):
        super().__init__(config, model_config, device_mesh)
        c = self.config
        rollout_world_size = c.tensor_model_parallel_size * c.data_parallel_size * c.pipeline_model_parallel_size
        rank = int(os.environ.get("RANK", 0))
        self.replica_rank = rank // rollout_world_size if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % rollout_world_size

    @functools.cached_property
    def _server(self):  # this replica's server actor, looked up on first use
        return ray.get_actor(server_name(self.replica_rank))

    resume = release = _nothing  # the server holds no device memory

    async def update_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                             wire_format: str = "named_tensors", peft_config: Any = None, base_sync_done: bool = False,
                             global_steps: Optional[int] = None, **kwargs):
        """verl's weight sync (``verl/workers/engine_workers.py`` ``update_weights``, 786-806): full weights, or
        with LoRA (``model.lora.merge=False``) the base weights once, then the adapter tensors every sync."""
        if wire_format != "named_tensors":
            raise NotImplementedError(f"hf rollout: wire_format={wire_format!r} (only named_tensors)")
        state_dict = {}
        # Every rank must drain the generator: DTensor.full_tensor() inside it is a collective. A checkpoint
        # engine's receive_weights (standalone / colocated replicas, verl's CheckpointEngineWorker) is async.
        async for name, tensor in ensure_async_iterator(weights):
            if self.rollout_rank == 0:
                state_dict[name] = tensor.detach().to("cpu", copy=True)
        if self.rollout_rank != 0:
            return
        if peft_config is not None and base_sync_done:  # verl's adapter sync: LoRA tensors only
            await self._server.update_lora.remote(state_dict, peft_config, global_steps)
        else:  # full weights; LoRA base weights (first sync) or merged weights (model.lora.merge=True)
            await self._server.update_weights.remote(state_dict, global_steps)
