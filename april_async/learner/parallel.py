"""The learner's processes and its model across them: one ``torch.distributed`` group, FSDP2.

``join(cfg)`` forms the group from the torchrun-style environment ``april up`` sets (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``): gloo on the CPU, NCCL on CUDA,
and beside it a gloo group for the small control objects rank 0 sends the others (commands,
their share of a batch). One rank on the CPU forms no group at all: the model stays a plain
module and every collective below is a no-op.

``ShardedPolicy`` is the model and its optimizer on that group:

- the model is built on the meta device, each decoder layer and then the root wrapped with
  ``fully_shard`` (FSDP2), materialised on the rank's device and loaded — from a Hugging Face
  checkpoint that rank 0 reads and broadcasts, or from a sharded checkpoint every rank reads
  its own part of;
- on CUDA with ``dtype = bfloat16`` it is mixed precision: float32 master weights and optimizer
  state, bfloat16 compute, float32 gradient reduction (``MixedPrecisionPolicy``). A single CUDA
  rank forms a group of one so that the same policy applies;
- gradients must be summed over ranks, since each rank's loss is already divided by the whole
  step's denominator (``losses.policy_loss``); FSDP averages them, so ``backward`` scales the
  loss by the number of ranks first (gloo has no pre-multiplied sum that would spare it);
- ``full_weights`` gathers the full tensors one at a time (every rank takes part, rank 0 keeps
  them), in the compute dtype, for the hand-off and the Hugging Face export;
- ``save_sharded``/``load_sharded``: model and optimizer through ``torch.distributed.checkpoint``,
  which reshards on load, so a checkpoint written at 2 ranks resumes at 1 or 4.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from april_async.learner.config import LearnerConfig
from april_async.learner import hf, lora
from april_async.model.errors import CheckpointError
from april_async.runtime import resolve_device

GROUP_TIMEOUT_S = 1800.0
"""A collective that waits longer than this fails (a rank stopped answering). Rank 0 keeps idle
ranks busy with ``idle`` commands far more often (``IDLE_COMMAND_S`` in the actor)."""
SHARDED_DIR = "sharded"
"""Inside a checkpoint directory: the ``torch.distributed.checkpoint`` files of model and optimizer."""



@dataclass
class LearnerGroup:
    """This process's place among the learner's ranks."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    control: object | None = None
    """The gloo group control objects travel on (None: no group was formed)."""

    @property
    def distributed(self) -> bool:
        return self.control is not None

    def broadcast(self, obj=None):
        """Rank 0's ``obj`` on every rank (pickled over the control group)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def scatter(self, objs: list | None = None):
        """Rank r gets ``objs[r]`` of rank 0's list."""
        if not self.distributed:
            return objs[0]
        out = [None]
        dist.scatter_object_list(out, objs if self.rank == 0 else None, src=0, group=self.control)
        return out[0]

    def all_sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over the ranks (float64)."""
        if not self.distributed or self.world == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.control)
        return t.tolist()

    def close(self, *, clean: bool = False) -> None:
        """Leave the group; ``clean``: every rank is leaving now (after ``stop``), so meet first and
        no rank tears its connections down while another still reads from them."""
        if dist.is_initialized():
            if clean and self.distributed:
                dist.barrier(group=self.control)
            dist.destroy_process_group()


def join(cfg: LearnerConfig, env: dict[str, str] | None = None) -> LearnerGroup:
    """Form (or skip) the learner's group from the environment; see the module docstring."""
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", "1"))
    rank = int(env.get("RANK", "0"))
    local_rank = int(env.get("LOCAL_RANK", str(rank)))
    if world != cfg.ranks:
        raise ValueError(f"learner.ranks = {cfg.ranks} but WORLD_SIZE = {world}: start the learner with "
                         f"`april up` (which starts every rank) or with torchrun --nproc-per-node {cfg.ranks}")
    if not 0 <= rank < world:
        raise ValueError(f"RANK = {rank} is not in 0..{world - 1}")
    device = resolve_device(cfg.device, local_rank)
    group = LearnerGroup(rank, world, local_rank, device)
    if world == 1 and device.type == "cpu":
        return group
    timeout = timedelta(seconds=GROUP_TIMEOUT_S)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world == 1:  # a group of one (CUDA): FSDP's mixed precision with no rendezvous
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout,
                                device_id=device)
    else:
        for key in ("MASTER_ADDR", "MASTER_PORT"):
            if key not in env:
                raise ValueError(f"learner.ranks = {world}: {key} is not set (april up sets it from run.learner_port)")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://", rank=rank,
                                world_size=world, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    group.control = dist.new_group(backend="gloo", timeout=timeout) if device.type == "cuda" else dist.group.WORLD
    return group


def compute_dtype(cfg: LearnerConfig, device: torch.device) -> torch.dtype:
    """What the model computes in: ``dtype``, with ``auto`` bfloat16 on CUDA and float32 on the CPU."""
    name = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


class ShardedPolicy:
    """The learner's model and optimizer on its group (see the module docstring)."""

    def __init__(self, cfg: LearnerConfig, group: LearnerGroup, source: Path, *, sharded: bool,
                 base: Path | None = None):
        """``source``: a checkpoint directory; ``sharded``: resume from its sharded state (model and
        optimizer), else load its Hugging Face weights and start a fresh optimizer. With
        ``cfg.lora``, ``base`` is the frozen base checkpoint (default ``source``): its weights are
        loaded, wrapped with a fresh adapter, and a sharded ``source`` then holds the adapter and
        its optimizer state alone."""
        self.group = group
        self.lora = cfg.lora
        base = Path(base if base is not None else source)
        self.device = group.device
        self.dtype = compute_dtype(cfg, group.device)
        self.attention = hf.attention(cfg.attention, group.device)
        self.packed = self.attention in hf.PACKING_ATTENTION if cfg.pack_rows is None else cfg.pack_rows
        mixed = group.device.type == "cuda" and self.dtype != torch.float32
        storage = torch.float32 if mixed else self.dtype
        config = hf.read_config(base if self.lora else source)
        if group.distributed or sharded:
            model = hf.empty_model(config, storage, self.attention)
            if cfg.activation_checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            hf_model = model
            if self.lora:
                model = lora.wrap(model, self.lora)
            if group.distributed:
                from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

                mp = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32) if mixed \
                    else MixedPrecisionPolicy()
                for layer in hf.decoder_layers(hf_model):
                    fully_shard(layer, mp_policy=mp)
                fully_shard(model, mp_policy=mp)
            model.to_empty(device=group.device)
            if not group.distributed:
                hf_model.tie_weights()  # to_empty gave the tied tensors two storages
            hf.fill_buffers(hf_model)
            if not sharded or self.lora:  # a LoRA checkpoint holds no base weight
                self._load_hf(model, base if self.lora else source, storage, config)
        else:
            model = hf.load_pretrained(source, storage, self.attention, config)
            if cfg.activation_checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            hf_model = model
            if self.lora:
                model = lora.wrap(model, self.lora)
            model = model.to(group.device)
        self.model = model.train()
        self.hf_model = hf_model
        """The ``transformers`` model (inside the ``peft`` wrapper with ``lora``)."""
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=cfg.lr, betas=cfg.betas,
                                           weight_decay=cfg.weight_decay)
        self._keys = self._version_keys()
        if sharded:
            self.load_sharded(source)

    def _load_hf(self, model, source: Path, storage: torch.dtype, config) -> None:
        """Rank 0 reads the Hugging Face checkpoint (checking it) and broadcasts it into the shards
        (with ``lora``, wrapped first: the fresh adapter rank 0 draws goes to every rank)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full = {}
        if self.group.rank == 0:
            loaded = hf.load_pretrained(source, storage, self.attention, config)
            full = (lora.wrap(loaded, self.lora) if self.lora else loaded).state_dict()
        if not self.group.distributed:
            model.load_state_dict(full)
            return
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))

    def _version_keys(self) -> list[tuple[str, str]]:
        """``(state-dict key, name on the wire)`` of what a version carries: every tensor, or with
        ``lora`` the adapter's (``lora.wire_name``)."""
        keys = list(self.model.state_dict())
        if not self.lora:
            return [(k, k) for k in keys]
        return [(k, w) for k in keys if (w := lora.wire_name(k)) is not None]

    # ------------------------------------------------------------------ training

    def logprobs(self, inputs: torch.Tensor, targets: torch.Tensor, temperature: float,
                 lengths: torch.Tensor | None = None) -> torch.Tensor:
        """log π(target | prefix) at ``temperature`` for every position: [N, L] (float32), zero
        past each row's ``lengths`` (its tokens; default: the whole row). With ``packed`` the rows
        go through the model as one sequence whose position ids restart at each row."""
        if not self.packed or inputs.shape[0] == 1:
            return target_logprobs(self._logits(inputs), targets, temperature)
        if lengths is None:
            lengths = torch.full((inputs.shape[0],), inputs.shape[1], dtype=torch.long, device=inputs.device)
        keep = torch.arange(inputs.shape[1], device=inputs.device)[None, :] < lengths[:, None]  # [N, L]
        positions = torch.cat([torch.arange(int(n), device=inputs.device) for n in lengths.tolist()])
        logits = self._logits(inputs[keep][None], positions[None])
        out = torch.zeros(inputs.shape, dtype=torch.float32, device=inputs.device)
        out[keep] = target_logprobs(logits, targets[keep][None], temperature)[0]
        return out

    def _logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of ``loss``, this rank's share of the step (see the module docstring)."""
        (loss * self.group.world if self.group.distributed else loss).backward()

    def idle_forward(self) -> None:
        """A forward of one token (no gradient) for a rank with no rows where the others have some."""
        self._logits(torch.zeros(1, 1, dtype=torch.long, device=self.device))

    def idle_backward(self) -> None:
        """A forward and backward that changes no gradient: a rank with no rows in a micro-batch
        still takes part in the collectives of the others'."""
        logits = self._logits(torch.zeros(1, 1, dtype=torch.long, device=self.device))
        self.backward(logits.float().sum() * 0.0)

    def step(self, lr: float, max_norm: float) -> float:
        """Clip the summed gradients, take one optimizer step, clear them; the norm before clipping."""
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        norm = torch.nn.utils.clip_grad_norm_(self.trainable, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())  # a tied weight once

    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.trainable)

    # ------------------------------------------------------------------ full weights out

    def shapes(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """Every tensor of the model's Hugging Face state dict (with ``lora``: the base's names, the
        adapter merged) with the dtype and shape ``full_weights`` gives it."""
        state = self.model.state_dict()
        if not self.lora:
            return [(k, self.dtype, tuple(v.shape)) for k, v in state.items()]
        return [(lora.base_name(k), self.dtype, tuple(v.shape)) for k, v in state.items()
                if lora.wire_name(k) is None]

    def full_weights(self, names: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor | None]]:
        """``(name, full tensor)`` in the order of ``shapes`` (of ``names`` only, when given),
        gathered one at a time: a collective every rank joins. Rank 0 gets CPU tensors in the
        compute dtype; the other ranks get None. With ``lora`` the names are the base's Hugging
        Face names and each target's weight comes merged (``lora.merge``, in float32)."""
        state = self.model.state_dict()
        if not self.lora:
            for name in names if names is not None else list(state):
                yield name, self._gather(state[name], self.dtype)
            return
        keys = {lora.base_name(k): k for k in state if lora.wire_name(k) is None}
        pairs = {}
        for k in state:
            if (w := lora.wire_name(k)) is not None:
                pairs.setdefault(w.rsplit(".lora_", 1)[0] + ".weight", {})[w[-8]] = k  # "A" or "B"
        for name in names if names is not None else list(keys):
            t = self._gather(state[keys[name]])
            ab = pairs.get(name)
            if ab is not None:
                a, b = self._gather(state[ab["A"]]), self._gather(state[ab["B"]])
                if t is not None:
                    t = lora.merge(t, a, b, self.lora.scale)
            yield name, (t.to(self.dtype) if t is not None else None)

    def version_shapes(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """What one version carries, by its names on the wire: every tensor, or the adapter's."""
        state = self.model.state_dict()
        return [(w, self.dtype, tuple(state[k].shape)) for k, w in self._keys]

    def version_weights(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor | None]]:
        """``full_weights`` of a version's tensors, by their names on the wire (a collective)."""
        state = self.model.state_dict()
        key = {w: k for k, w in self._keys}
        for name in names:
            yield name, self._gather(state[key[name]], self.dtype)

    def _gather(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """The full tensor of a shard (a collective), on rank 0 as a detached CPU tensor (in
        ``dtype``, default its own), else None."""
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        return t.detach().to("cpu", dtype or t.dtype) if self.group.rank == 0 else None

    # ------------------------------------------------------------------ sharded state

    def _state(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        # With lora the frozen base is the base checkpoint's: only the adapter is saved.
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer,
                                            options=StateDictOptions(ignore_frozen_params=bool(self.lora)))
        return {"model": model_sd, "optim": optim_sd}

    def save_sharded(self, directory: Path) -> None:
        """Every rank writes its shards of model and optimizer under ``directory/sharded``."""
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "existing checkpoint ... overwriting"
            dcp.save(self._state(), checkpoint_id=str(Path(directory) / SHARDED_DIR))

    def load_sharded(self, directory: Path) -> None:
        """Read ``directory/sharded`` into this policy, resharded for this group."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        path = Path(directory) / SHARDED_DIR
        if not (path / ".metadata").is_file():
            raise CheckpointError(f"checkpoint {str(directory)!r}: {SHARDED_DIR}/.metadata is missing")
        state = self._state()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "... assuming the intent is to load in a single process"
                dcp.load(state, checkpoint_id=str(path))
        except (CheckpointException, RuntimeError, OSError, ValueError) as e:  # DCP gathers every rank's failure
            raise CheckpointError(f"{path}: cannot be read into this model and optimizer "
                                  f"({str(e).strip().splitlines()[-1][:300]})") from None
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"],
                       options=StateDictOptions(ignore_frozen_params=bool(self.lora), strict=not self.lora))


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) at ``targets``, as the target's logit minus the log-sum-exp: the
    backward pass then keeps only the logits, not a second [N, L, vocab] tensor of log-probs."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    return z.gather(-1, targets[..., None])[..., 0] - torch.logsumexp(z, dim=-1)
